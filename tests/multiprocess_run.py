"""One process of a multi-process save/load run (see test_multiprocess.py).

Usage: python tests/multiprocess_run.py PROCESS_ID NUM_PROCESSES PORT DIRECTORY

Every process joins a ``jax.distributed`` run on localhost, sees the global
8-device CPU mesh, saves sharded parameters with pz_persist (each process its
own shards), loads them back by axis rules, and prints a JSON report of what
it checked.
"""

from __future__ import annotations

import json
import os
import sys

PROCESS_ID, NUM_PROCESSES, PORT, DIRECTORY = (
    int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // NUM_PROCESSES}"

import jax  # noqa: E402  pylint: disable=wrong-import-position

jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{PORT}",
    num_processes=NUM_PROCESSES,
    process_id=PROCESS_ID,
    initialization_timeout=120,
)

import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
from penzai import pz  # noqa: E402  pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_zoo  # noqa: E402  pylint: disable=wrong-import-position

import pz_persist as pzp  # noqa: E402  pylint: disable=wrong-import-position
from pz_persist.format import manifest as manifest_lib

RULES = {"embedding": "data", "neurons": "model", "vocabulary": "model", "projection": "model"}

manifest_writes = []
_write = manifest_lib.write
manifest_lib.write = lambda directory, manifest: (manifest_writes.append(str(directory)), _write(directory, manifest))[1]


def global_params(local_params, rules):
  """The same parameters as global arrays spread over all processes."""

  def globalize(param):
    data = np.asarray(param.value.data_array)
    sharding = rules.sharding(tuple(param.value.named_axes), data.shape, what=param.label)
    array = jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
    return pz.ParameterValue(
        label=param.label, value=pz.nx.NamedArray(param.value.named_axes, array),
        metadata=param.metadata,
    )

  return tuple(globalize(p) for p in local_params)


def check_shards(params, expected):
  """Each process holds exactly its own shards, with the expected values."""
  count = 0
  for param, reference in zip(params, expected):
    assert param.label == reference.label
    array, data = param.value.data_array, np.asarray(reference.value.data_array)
    assert array.shape == data.shape and not array.is_fully_addressable
    for shard in array.addressable_shards:
      assert np.array_equal(np.asarray(shard.data), data[shard.index]), param.label
      count += 1
  return count


mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
rules = pzp.AxisRules(mesh, RULES)
model = model_zoo.llamalike_transformer()
_, local = pz.unbind_params(model, freeze=True)
report = {"process": PROCESS_ID, "devices": jax.device_count(), "local": jax.local_device_count()}

params = global_params(local, rules)
path = os.path.join(DIRECTORY, "ckpt")
pzp.save(path, params)
report["saved_manifest_writes"] = len(manifest_writes)
report["load_shards"] = check_shards(pzp.load(path, sharding=rules), local)

pzp.save(path, params, overwrite=True)
report["overwrite_shards"] = check_shards(pzp.load(path, sharding=rules), local)

with pzp.CheckpointManager(os.path.join(DIRECTORY, "run"), max_to_keep=1) as manager:
  for step in (1, 2):
    # Two array items: their checksums are hashed and exchanged in two
    # background threads at once, which must not pair up the wrong digests.
    manager.save(step, params=params, again=params, meta={"step": step})
  manager.wait_until_finished()
  restored = manager.restore(sharding=rules)
  report["manager_steps"] = manager.all_steps()
report["manager_shards"] = check_shards(restored["params"], local)
report["manager_again_shards"] = check_shards(restored["again"], local)
report["manager_meta"] = restored["meta"]

bound = pzp.load_into(path, model, sharding=rules)
report["bound_shards"] = check_shards(pz.unbind_params(bound, freeze=True)[1], local)
report["manifest_writes"] = len(manifest_writes)
print(json.dumps(report), flush=True)
jax.distributed.shutdown()
