"""A process that saves and loads remote checkpoints on command (stdin).

Why a long-lived process: racing saves must come from separate processes
(as on a cluster), and starting JAX for each trial would make repeated
trials slow. The test starts two workers once and sends each line-commands:

  save PATH VALUE START_AT OVERWRITE   -> "won" / "lost" / "error: ..."
  overwrite PATH COUNT                 -> "done N" after COUNT overwrites
  quit

Every tree it saves is `tree(value)`: every array filled with ``value``, so
a reader can tell a whole checkpoint (all arrays one value) from a mix.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import pz_persist as pzp


def tree(value: float, arrays: int = 6, size: int = 4096) -> dict:
  return {f"a{i}": np.full((size,), value, np.float32) for i in range(arrays)}


def values(loaded: dict) -> set:
  """The values a loaded tree holds: one for a whole checkpoint."""
  return {float(v) for array in loaded.values() for v in np.unique(array)}


def main() -> None:
  print("ready", flush=True)
  for line in sys.stdin:
    parts = line.split()
    if not parts or parts[0] == "quit":
      return
    try:
      if parts[0] == "save":
        path, value, start_at, overwrite = parts[1], float(parts[2]), float(parts[3]), parts[4]
        while time.time() < start_at:
          time.sleep(0.0005)
        try:
          pzp.save(path, tree(value), overwrite=overwrite == "1")
          print("won", flush=True)
        except pzp.errors.ConcurrentSaveError:
          print("lost", flush=True)
      elif parts[0] == "overwrite":
        path, count = parts[1], int(parts[2])
        for i in range(count):
          pzp.save(path, tree(float(i + 1)), overwrite=True)
        print(f"done {count}", flush=True)
    except Exception as e:  # pylint: disable=broad-exception-caught
      print(f"error: {type(e).__name__}: {e}".replace("\n", " "), flush=True)


if __name__ == "__main__":
  main()
