"""One process of a two-process load of a mixture of experts sharded by
experts (see test_moe_sharding.py).

Usage: python tests/moe_multiprocess_run.py PROCESS_ID NUM_PROCESSES PORT FOLDER

Every process joins a ``jax.distributed`` run on localhost (8 CPU devices in
all), loads the Hugging Face folder with ``experts`` on the mesh axis
``expert``, and prints a JSON report: for each expert parameter, which
experts this process's shards hold and whether they hold the folder's
values.
"""

from __future__ import annotations

import json
import os
import sys

PROCESS_ID, NUM_PROCESSES, PORT, FOLDER = (
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
import safetensors.numpy  # noqa: E402  pylint: disable=wrong-import-position
from penzai import pz  # noqa: E402  pylint: disable=wrong-import-position

import pz_persist as pzp  # noqa: E402  pylint: disable=wrong-import-position

# The experts over the mesh's "expert" axis, which spans the processes: each
# process holds the experts of its own devices.
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("expert", "data"))
rules = pzp.AxisRules(mesh, {"experts": "expert"})
model = pzp.pretrained.load_hf(FOLDER, sharding=rules, progress=False)
stored = safetensors.numpy.load_file(os.path.join(FOLDER, "model.safetensors"))

report = {"process": jax.process_index(), "devices": jax.device_count(),
          "local": jax.local_device_count(), "experts": {}}
for param in pz.unbind_params(model)[1]:
  if "/experts/" not in param.label:
    continue
  value = param.value
  axes = tuple(value.named_axes)
  array = value.data_array
  dim = axes.index("experts")
  held, matches = set(), True
  part = {"gate": "w1", "up": "w3", "down": "w2"}[param.label.rsplit("/", 1)[1].split(".")[0]]
  block = param.label.split("/")[1].removeprefix("block_")
  for shard in array.addressable_shards:
    index = shard.index[dim]
    experts = range(*index.indices(array.shape[dim]))
    held.update(experts)
    data = np.asarray(shard.data)
    for j, e in enumerate(experts):
      want = stored[f"model.layers.{block}.block_sparse_moe.experts.{e}.{part}.weight"]
      got = np.take(data, j, axis=dim)
      # The stored (out, in) matrix in the parameter's remaining axis order.
      rest = [a for a in axes if a != "experts"]
      if rest != (["embedding", "neurons"] if part == "w2" else ["neurons", "embedding"]):
        got = got.T
      matches &= bool(np.array_equal(got, want))
  report["experts"][param.label] = {
      "held": sorted(held), "matches": matches,
      "spec": str(array.sharding.spec), "addressable": len(array.addressable_shards)}
print(json.dumps(report))
