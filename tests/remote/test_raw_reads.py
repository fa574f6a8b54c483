"""Small arrays on gs:// and s3:// are read as raw OCDBT entries too.

`pz_persist.storage.reading.raw_chunks` reads them from the item's OCDBT key-value
store, whatever its base (a local directory, a bucket): the same checks hold
on an object store, where no containment walk applies.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors
from pz_persist.storage.reading import direct_read
from pz_persist.storage.reading import opening


@pytest.fixture
def writable(remote, store) -> str:
  """``remote``, on a store Orbax can write arrays to."""
  if store.scheme == "s3":
    pytest.importorskip("pz_persist.storage.stores.s3_kvstore").enable_orbax_s3()
  return remote


def _tree():
  return {
      "small": pz.ParameterValue(label="small", value=pz.nx.wrap(jnp.arange(256.0), "x")),
      "bf16": jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16),
      "numpy": np.arange(12, dtype=np.int16).reshape(3, 4),
      "large": jnp.arange(300_000.0),  # Over 1 MiB: through ts.open.
  }



def _chunk_store(path: str):
  """The item's OCDBT store, and the chunk key of the array labelled "small"."""
  item, manifest = opening.read(path, lambda opened: (opened.item, opened.manifest))
  key = next(spec.key for spec in manifest.arrays if spec.label == "small")
  context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
  spec = direct_read._read_spec(item, key, False, True, context)  # pylint: disable=protected-access
  kvstore = ts.KvStore.open({**spec["kvstore"], "path": ""}, context=context).result()
  return kvstore, f"{key}/0"


def test_small_arrays_load_as_raw_chunks(writable, tensorstore_opens):
  path = f"{writable}/ckpt"
  pzp.save(path, _tree())
  assert_identical(pzp.load(path), _tree())
  assert tensorstore_opens == ["tree['large']"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_raw_chunk_is_refused(writable):
  path = f"{writable}/ckpt"
  pzp.save(path, _tree())
  kvstore, key = _chunk_store(path)
  data = bytearray(kvstore.read(key).result().value)
  data[100] ^= 0xFF
  kvstore.write(key, bytes(data)).result()
  with pytest.raises(errors.IntegrityError, match=r"label 'small'.*differ"):
    pzp.load(path)
  kvstore.write(key, bytes(data[:-4])).result()  # Short: left to ts.open, which refuses it.
  with pytest.raises(errors.IntegrityError, match=r"cannot read the stored array\(s\) of label 'small'"):
    pzp.load(path)
