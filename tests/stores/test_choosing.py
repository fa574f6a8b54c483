"""How a path's store is chosen: once, from its spelling alone, changing
nothing process-wide until an entry point hands the path to Orbax."""

from __future__ import annotations

import pytest
from conftest import run_python

from pz_persist import errors
from pz_persist.storage import stores
from pz_persist.storage.stores import gcs
from pz_persist.storage.stores import local
from pz_persist.storage.stores import s3


@pytest.mark.parametrize(("path", "kind"), [
    ("/runs/ck", local.LocalStore), ("ck", local.LocalStore), ("~/ck", local.LocalStore),
    ("file:///runs/ck", local.LocalStore), ("file://localhost/runs/ck", local.LocalStore),
    ("gs://bucket/ck", gcs.GcsStore), ("s3://bucket/ck", s3.S3Store),
    ("GS://bucket/ck", gcs.GcsStore),  # Chosen; `normalise` then refuses the spelling.
])
def test_the_scheme_alone_chooses(path, kind):
  assert isinstance(stores.for_path(path), kind)


@pytest.mark.parametrize("path", ["hdfs://nn/ck", "http://host/ck", "file://server/ck"])
def test_other_schemes_are_refused_by_name(path):
  with pytest.raises(errors.UnsupportedStorageError, match=path.split("/")[0]):
    stores.for_path(path)


def test_choosing_never_asks_fsspec():
  """GCS is told from S3 by the URL, not by what fsspec's listings hold: with
  fsspec and both its stores unimportable, each path still gets its store."""
  out = run_python("""
      import sys
      for name in ("fsspec", "gcsfs", "s3fs"):
        sys.modules[name] = None  # Importing it now raises ImportError.
      from pz_persist.storage import stores
      print(type(stores.for_path("gs://b/ck")).__name__,
            type(stores.for_path("s3://b/ck")).__name__)
      try:
        stores.normalise("gs://b/ck")
      except Exception as e:
        print(type(e).__name__, "pz-persist[gcs]" in str(e))
  """, timeout=120)
  assert "GcsStore S3Store" in out
  assert "MissingExtraError True" in out  # Its extra is named only when used.


def test_normalising_changes_nothing_process_wide_opening_for_orbax_does():
  """``stores.choose`` (every entry point's normalisation), the leftovers
  finder and the destination check leave Orbax as it is; only an entry point
  handing an ``s3://`` path to Orbax (`stores.open_path`) teaches it S3."""
  out = run_python("""
      from pz_persist.storage import destinations, stores
      from pz_persist.storage.stores import s3_kvstore
      stores.choose("s3://bucket/ck")
      stores.normalise("s3://bucket/ck/")
      destinations.check_apart("s3://bucket/a", ["s3://bucket/b"])
      print("after normalising", s3_kvstore.is_enabled())
      stores.open_path("gs://bucket/ck")
      print("after opening gs", s3_kvstore.is_enabled())
      stores.open_path("s3://bucket/ck")
      print("after opening s3", s3_kvstore.is_enabled())
  """, timeout=120)
  assert "after normalising False" in out
  assert "after opening gs False" in out
  assert "after opening s3 True" in out
