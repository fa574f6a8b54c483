"""What bounds pz_persist's per-array costs from below, measured in one run.

`many_arrays.py` says how much each array costs a save, a load and `inspect`;
this script says how much of that is work no implementation in Python can skip
on this machine, by timing its parts alone, in the same warm process, on the
same checkpoint of N small arrays (best of ``--repeats``):

* ``inspect``: reading the manifest's bytes, Python's own C JSON parser on
  them (no checks: the floor of any JSON manifest of this size), the same
  parse with pz_persist's checks (size and depth scan, duplicate keys, the
  array table), and decoding the tree;
* ``load``: what the read of the arrays costs (`reader.read_arrays`, all of
  it, and the direct read alone), and its parts: opening every array with
  TensorStore (what the ``ts.open`` path pays per array, and the raw-chunk
  path skips), the raw-chunk path's batched reads of every ``.zarray`` and
  then of every chunk from the item's OCDBT key-value store (plain
  ``KvStore.read`` calls, nothing else: the floor of reading two entries an
  array through TensorStore), hashing every array alone (xxHash3-128, the
  checksums), handing every host array to JAX (one ``device_put``), and
  building the Penzai values through their public constructors
  (``pz.Parameter``, ``NamedArray``), and the time Python's cyclic garbage
  collector spends inside one load (its collections, timed through
  ``gc.callbacks``: pz_persist may not pause the collector, see
  ``tests/hostile/test_collector_state.py``);
* ``save``: encoding and validating the tree, and safetensors'
  ``save_file`` / ``load_file`` of the same arrays for reference.

Usage: python benchmarks/per_array_floors.py --count 4000
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from penzai import pz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  pylint: disable=wrong-import-position
import many_arrays  # noqa: E402  pylint: disable=wrong-import-position

import pz_persist as pzp  # noqa: E402  pylint: disable=wrong-import-position
from pz_persist.format import encode  # noqa: E402  pylint: disable=wrong-import-position
from pz_persist.format import manifest as manifest_lib  # noqa: E402  pylint: disable=wrong-import-position
from pz_persist.storage.integrity import checksums  # noqa: E402  pylint: disable=wrong-import-position
from pz_persist.storage.reading import direct_read  # noqa: E402  pylint: disable=wrong-import-position
from pz_persist.storage.reading import reader  # noqa: E402  pylint: disable=wrong-import-position
from pz_persist.storage.reading import restoring  # noqa: E402  pylint: disable=wrong-import-position


def best(operation: Callable[[], Any], repeats: int) -> float:
  operation()  # Warm.
  return harness.best_of(operation, repeats)


def measure(count: int, array_kib: float, repeats: int, directory: str) -> dict[str, float]:
  tree = many_arrays.build_tree(count, array_kib)
  path = os.path.join(directory, "ck")
  pzp.save(path, tree)
  item = os.path.join(path, "penzai")
  manifest_file = manifest_lib.manifest_path(item)
  data = manifest_file.read_bytes()
  manifest = manifest_lib.Manifest.loads(data, where=str(manifest_file))
  host = [np.asarray(leaf) for leaf in jax.tree.leaves(pzp.load(path))]
  specs = [spec for spec in manifest.arrays if spec.is_stored]
  axes = [("embedding", "neurons")] * len(host)

  def open_every_array():
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    read_specs = direct_read._read_specs(  # pylint: disable=protected-access
        epath.Path(item), [spec.key for spec in specs], False, True, context)
    futures = [ts.open(spec, open=True, read=True, context=context) for spec in read_specs]
    for future in futures:
      future.result()

  context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
  first_spec = direct_read._read_spec(  # pylint: disable=protected-access
      epath.Path(item), specs[0].key, False, True, context)
  kvstore = ts.KvStore.open({**first_spec["kvstore"], "path": ""}, context=context).result()
  chunk_key = ".".join("0" * len(specs[0].shape)) or "0"

  def read_entries(suffix):
    futures = [kvstore.read(f"{spec.key}/{suffix}") for spec in specs]
    return [future.result().value for future in futures]

  def hash_every_array():
    for array in host:
      checksums.digest_of(array)

  def collector_time_in_one_load():
    """Seconds the cyclic collector ran during the fastest of ``repeats`` loads."""
    started, spent = [0.0], [0.0]

    def timing(phase, info):
      del info
      if phase == "start":
        started[0] = time.perf_counter()
      else:
        spent[0] += time.perf_counter() - started[0]

    gc.callbacks.append(timing)
    try:
      fastest = None
      for _ in range(repeats):
        spent[0] = 0.0
        begin = time.perf_counter()
        pzp.load(path)
        took = time.perf_counter() - begin
        if fastest is None or took < fastest[0]:
          fastest = (took, spent[0])
      return fastest[1] if fastest else 0.0
    finally:
      gc.callbacks.remove(timing)

  def build_penzai_values():  # What decoding builds for each array.
    return [
        pz.ParameterValue(label=f"p{i}", value=pz.nx.NamedArray(
            named_axes=collections.OrderedDict(zip(names, array.shape)), data_array=array))
        for i, (names, array) in enumerate(zip(axes, device_arrays))
    ]

  device_arrays = jax.device_put(host, jax.devices()[0])
  safetensors_file = os.path.join(directory, "x.safetensors")
  flat = {f"a{i}": array for i, array in enumerate(host)}
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  def save_again():
    shutil.rmtree(path, ignore_errors=True)
    pzp.save(path, tree)

  results = {
      "inspect": best(lambda: pzp.inspect(path), repeats),
      "read manifest bytes": best(manifest_file.read_bytes, repeats),
      "json.loads (C parser, no checks)": best(lambda: json.loads(data), repeats),
      "manifest parse with pz_persist's checks": best(
          lambda: manifest_lib.Manifest.loads(data, where="m"), repeats),
      "decode the abstract tree": best(
          lambda: restoring.abstract_tree(manifest, where="m"), repeats),
      "load": best(lambda: pzp.load(path), repeats),
      "cyclic garbage collector inside the fastest load": collector_time_in_one_load(),
      "reader.read_arrays (read, verify, place)": best(
          lambda: jax.block_until_ready(reader.read_arrays(epath.Path(item), manifest)), repeats),
      "direct_read.read (host arrays, unverified)": best(
          lambda: direct_read.read(epath.Path(item), specs, where="m", on_read=lambda s, a: None),
          repeats),
      "ts.open of every array": best(open_every_array, repeats),
      "KvStore.read of every .zarray (one batch)": best(
          lambda: read_entries(".zarray"), repeats),
      "KvStore.read of every chunk (one batch)": best(
          lambda: read_entries(chunk_key), repeats),
      "xxh3_128 of every array (checksums alone)": best(hash_every_array, repeats),
      "jax.device_put of every host array (one call)": best(
          lambda: jax.block_until_ready(jax.device_put(host, jax.devices()[0])), repeats),
      "Penzai constructors (pz.Parameter + NamedArray)": best(build_penzai_values, repeats),
      "save": best(save_again, repeats),
      "encode and validate the tree": best(lambda: encode.encode(tree), repeats),
      "safetensors save_file": best(lambda: save_file(flat, safetensors_file), repeats),
      "safetensors load_file": best(lambda: load_file(safetensors_file), repeats),
  }
  return results


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--count", type=int, default=4000)
  parser.add_argument("--array-kib", type=float, default=16)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--dir", default=None)
  args = parser.parse_args(argv)
  directory = args.dir or tempfile.mkdtemp(prefix="pz_floors_")
  print(f"# per-array floors, {time.strftime('%Y-%m-%d %H:%M')} (load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())})")
  print(harness.machine_description())
  print(f"{args.count} arrays of {args.array_kib:g} KiB, one warm process, best of {args.repeats}\n")
  results = measure(args.count, args.array_kib, args.repeats, directory)
  harness.print_table(
      "Whole operations and their parts",
      ["what", "time", "ms per array"],
      [[name, f"{seconds * 1e3:.1f} ms", f"{seconds * 1e3 / args.count:.4f}"]
       for name, seconds in results.items()],
  )
  if args.dir is None:
    shutil.rmtree(directory, ignore_errors=True)
  return results


if __name__ == "__main__":
  main()
