"""Shared benchmark plumbing: sizes, isolated runs with peak memory, tables.

Every measured operation runs in a fresh Python process, so its peak resident
memory is its own (not left over from building data or from another method),
and a background thread samples the process's RSS while the operation runs.
All alternatives of one benchmark run on the same machine, in the same
invocation, on the same data, so the printed ratios compare like with like.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text: str) -> int:
  """'1GiB' -> 1073741824; accepts B, KiB, MiB, GiB, KB, MB, GB."""
  match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
  if not match or match.group(2).upper() not in _UNITS:
    raise ValueError(f"not a size: {text!r} (use e.g. 512MiB or 1GiB)")
  return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def format_size(nbytes: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(nbytes) < 1024 or unit == "GiB":
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
    nbytes /= 1024
  raise AssertionError


def _vm_hwm() -> int | None:
  """The kernel's high-water mark of this process's RSS (Linux), in bytes."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _reset_vm_hwm() -> bool:
  """Resets the high-water mark to the current RSS (Linux >= 4.0)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


class PeakRss:
  """Peak resident memory of this process while the ``with`` block runs.

  On Linux the kernel's own high-water mark is reset on entry and read on exit:
  exact, and immune to operations that hold the GIL (a sampling thread would
  miss their peak). Elsewhere a thread samples RSS every few milliseconds.
  """

  def __init__(self, interval: float = 0.002):
    self._process = psutil.Process()
    self._interval = interval
    self._stop = threading.Event()
    self.baseline = self._process.memory_info().rss
    self.peak = self.baseline
    self._kernel = False
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, self._process.memory_info().rss)
      time.sleep(self._interval)

  def __enter__(self) -> PeakRss:
    self._kernel = _reset_vm_hwm() and _vm_hwm() is not None
    self.baseline = self._process.memory_info().rss
    if not self._kernel:
      self._thread.start()
    return self

  def __exit__(self, *exc):
    if self._kernel:
      self.peak = max(_vm_hwm() or 0, self.baseline)
    else:
      self._stop.set()
      self._thread.join()
      self.peak = max(self.peak, self._process.memory_info().rss)

  @property
  def extra(self) -> int:
    """Peak RSS above what the process held when measuring started."""
    return self.peak - self.baseline


def measure(operation: Callable[[], Any]) -> dict[str, float]:
  """Times ``operation`` and its peak memory (call inside a worker process)."""
  with PeakRss() as rss:
    start = time.perf_counter()
    operation()
    seconds = time.perf_counter() - start
  return {"seconds": seconds, "peak_rss": rss.peak, "extra_rss": rss.extra}


def run_worker(script: str, args: list[str], *, env: dict | None = None, timeout: float = 3600) -> dict:
  """Runs ``script`` with ``args`` in a fresh interpreter; returns its JSON result.

  The worker prints one JSON object on its last line of stdout.
  """
  result = subprocess.run(
      [sys.executable, script, *args],
      capture_output=True,
      text=True,
      timeout=timeout,
      env={**os.environ, **(env or {})},
  )
  if result.returncode != 0:
    raise RuntimeError(
        f"benchmark worker {args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
  return json.loads(result.stdout.strip().splitlines()[-1])


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> str:
  """Prints and returns a Markdown table."""
  lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
  text = "\n".join(lines)
  print(text + "\n", flush=True)
  return text


PRETEND_DROP = "PZ_PERSIST_BENCH_PRETEND_DROP"
"""Set to 1 (the benchmarks' own tests): `drop_page_cache` drops nothing and
says it did, so the cold paths run without touching the machine's cache."""


def drop_page_cache() -> bool:
  """Drops the OS page cache if allowed (root on Linux); True on success."""
  if os.environ.get(PRETEND_DROP) == "1":
    return True
  try:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


def drop_page_cache_or_exit() -> None:
  """`drop_page_cache`, or the benchmark stops saying why (``--cold``)."""
  if not drop_page_cache():
    raise SystemExit("--cold needs root, to drop the page cache")


def machine_description() -> str:
  import platform

  return (
      f"{platform.node() or 'machine'}: {psutil.cpu_count()} cores,"
      f" {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {platform.platform()},"
      f" Python {platform.python_version()}"
  )


def timed_runs(
    operation: Callable[[], Any], runs: int, *, prepare: Callable[[], Any] | None = None
) -> list[float]:
  """Seconds of ``runs`` calls of ``operation`` in this process, in order.

  The first call is the one a fresh process pays; the later ones are what a
  warm process (a notebook repeating a load or save) pays, with every cache
  and allocator arena of the library already in place. ``prepare`` runs
  before each call, untimed (e.g. removing what the previous save wrote).
  """
  seconds = []
  for _ in range(runs):
    if prepare is not None:
      prepare()
    start = time.perf_counter()
    operation()
    seconds.append(time.perf_counter() - start)
  return seconds


def synced(operation: Callable[[], Any]) -> Callable[[], None]:
  """``operation`` followed by ``os.sync()``: a save is only done once its
  bytes are on disk, whether or not the library fsyncs its own files
  (Orbax and pz_persist do; safetensors and numpy do not)."""

  def run() -> None:
    operation()
    os.sync()

  return run


def best_and_median(seconds: list[float]) -> tuple[float, float]:
  import statistics

  return min(seconds), statistics.median(seconds)


def verdict(value: float, bound: float, *, at_least: bool) -> str:
  """'met' or 'NOT met' for ``value >= bound`` (``at_least``) or ``<= bound``."""
  return "met" if (value >= bound if at_least else value <= bound) else "NOT met"


def print_targets(title: str, rows: list[tuple[str, float, float, bool, str]]) -> str:
  """Prints a table of targets: (target, measured value, bound, at_least, unit).

  Unit ``x`` formats ratios (``1.23x``); anything else follows the number.
  """

  def show(value: float, unit: str) -> str:
    return f"{value:.2f}x" if unit == "x" else f"{value:.4g} {unit}"

  return print_table(title, ["target", "measured", "bound", "verdict"], [
      [name, show(value, unit), ("\u2265 " if at_least else "\u2264 ") + show(bound, unit),
       verdict(value, bound, at_least=at_least)]
      for name, value, bound, at_least, unit in rows
  ])


def finish(results: dict, *, json_path: str | None, directory: str | None = None) -> dict:
  """Writes ``results`` to ``json_path`` (if given) and removes ``directory``
  (the run's temporary directory, if it made one); returns ``results``."""
  if json_path:
    with open(json_path, "w") as f:
      json.dump(results, f, indent=1)
  if directory is not None:
    shutil.rmtree(directory, ignore_errors=True)
  return results


def best_of(operation: Callable[[], Any], repeats: int) -> float:
  """The shortest of ``repeats`` timed runs of ``operation``, in seconds."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    operation()
    times.append(time.perf_counter() - start)
  return min(times)
