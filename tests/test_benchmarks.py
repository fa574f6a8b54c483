"""The benchmarks keep working: a tiny run by default, the real one with -m slow."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import accelerator  # noqa: E402  pylint: disable=wrong-import-position
import async_save  # noqa: E402  pylint: disable=wrong-import-position
import integrity  # noqa: E402  pylint: disable=wrong-import-position
import lazy_open  # noqa: E402  pylint: disable=wrong-import-position
import many_arrays  # noqa: E402  pylint: disable=wrong-import-position
import per_array_floors  # noqa: E402  pylint: disable=wrong-import-position
import save_restore  # noqa: E402  pylint: disable=wrong-import-position
import sharded_restore  # noqa: E402  pylint: disable=wrong-import-position


def _check(results, methods):
  assert set(results["methods"]) == set(methods)
  for entry in results["methods"].values():
    assert entry["save"]["seconds"] > 0 and entry["restore"]["seconds"] > 0
    assert entry["disk_bytes"] > 0
  assert results["methods"]["pz_persist"]["inspect"]["seconds"] > 0


def test_save_restore_benchmark_runs(tmp_path, capsys):
  results = save_restore.main(["--size", "2MiB", "--repeats", "1", "--warm-runs", "1",
                                "--dir", str(tmp_path)])
  _check(results, save_restore.METHODS)
  assert set(results["warm"]) == set(save_restore.METHODS) - {"numpy"}
  assert all(len(times["save"]) == len(times["restore"]) == 1
             for times in results["warm"].values())
  assert all(entry["save_synced"]["seconds"] >= entry["save"]["seconds"]
             for entry in results["methods"].values())
  printed = capsys.readouterr().out
  assert "pz_persist's speed relative to each method" in printed
  assert "Warm process: save + sync and restore" in printed
  assert "Issue 19's targets" in printed and "save + sync vs orbax, warm (best)" in printed
  assert "restore vs safetensors, warm (median)" in printed and "restore peak RSS" in printed
  assert "pz_persist.inspect" in printed and "only=" in printed
  only = results["methods"]["pz_persist"]["only"]
  assert only["smallest"]["bytes"] < only["largest"]["bytes"]


def test_accelerator_benchmark_runs(tmp_path, capsys):
  """Runs on the CPU here (the default device); on a GPU machine the same
  script restores onto the GPU and checks every array landed there."""
  results = accelerator.main(["--size", "1MiB", "--repeats", "1", "--warm-runs", "1",
                              "--dir", str(tmp_path)])
  assert set(results["methods"]) == set(accelerator.METHODS)
  assert all(entry["fresh"][0] > 0 and entry["warm"][0] > 0
             for entry in results["methods"].values())
  printed = capsys.readouterr().out
  assert "restore onto" in printed
  # Onto the CPU, the accelerator targets (peak host memory 0.25x) are not
  # judged: the arrays are host memory there.
  assert "targets 1-2 left out" in printed and "peak host RSS / data" not in printed


def test_accelerator_benchmark_cold_restores_run(tmp_path, capsys, monkeypatch):
  """The --cold path (page cache dropped after each process's warm-up, fresh
  and warm processes, the checkpoint's files read as the floor), without
  dropping this machine's cache for real."""
  monkeypatch.setenv(accelerator.harness.PRETEND_DROP, "1")
  accelerator.main(["--size", "1MiB", "--repeats", "1", "--warm-runs", "2", "--cold",
                    "--methods", "pz_persist,safetensors_host", "--dir", str(tmp_path),
                    "--json", str(tmp_path / "out.json")])
  cold = __import__("json").loads((tmp_path / "out.json").read_text())["restores"]
  cold = next(iter(cold.values()))["cold"]
  assert set(cold) == {"pz_persist", "safetensors_host", "floor"}
  assert all(cold[m]["fresh"] > 0 and cold[m]["warm"] > 0 for m in ("pz_persist", "safetensors_host"))
  assert cold["floor"]["files"] > 0 and cold["floor"]["pieces"] > 0
  printed = capsys.readouterr().out
  assert "the pz_persist checkpoint's files read cold" in printed
  assert "in 4 MiB pieces, a descriptor each" in printed
  assert "cold, warm process, vs its files read cold" in printed


def test_accelerator_benchmark_cold_without_root_stops_at_once(tmp_path, monkeypatch):
  """--cold where the page cache cannot be dropped says so before anything
  is written or timed (it used to run every warm restore, then leave the
  cold table out without a word)."""
  monkeypatch.setattr(accelerator.harness, "drop_page_cache", lambda: False)
  with pytest.raises(SystemExit, match="--cold needs root"):
    accelerator.main(["--size", "1MiB", "--cold", "--dir", str(tmp_path)])
  assert not os.listdir(tmp_path)


def test_transformer_shapes_reach_the_requested_size():
  for size in (64 * 2**20, 2**30):
    shapes = save_restore.transformer_shapes(size)
    nbytes = sum(4 * int(__import__("numpy").prod([n for _, n in axes])) for _, axes in shapes)
    assert size <= nbytes <= 1.3 * size


@pytest.mark.slow
def test_save_restore_benchmark_1gib(tmp_path):
  results = save_restore.main(["--size", "1GiB", "--repeats", "3", "--dir", str(tmp_path)])
  _check(results, save_restore.METHODS)


def test_async_save_benchmark_runs(tmp_path, capsys):
  results = async_save.main(
      ["--state-size", "24MiB", "--saves", "2", "--steps-between", "1", "--dir", str(tmp_path),
       "--paired-rounds", "2"]
  )
  assert set(results) == {"sync", "async", "orbax", "ratio", "ratio_to_orbax", "paired"}
  assert all(len(results["paired"][name]) == 2 for name in ("pz_persist", "orbax"))
  assert all(len(results[mode]["blocked"]) == 2 for mode in ("sync", "async", "orbax"))
  printed = capsys.readouterr().out
  assert "async blocked time / sync save time" in printed
  assert "plain Orbax async blocked time" in printed and "Taking turns" in printed
  assert "Issue 19's async save targets" in printed and "taking turns in one process" in printed


@pytest.mark.slow
def test_async_save_benchmark_576mib(tmp_path):
  results = async_save.main(["--state-size", "576MiB", "--dir", str(tmp_path)])
  assert results["ratio"] > 0


def test_many_arrays_benchmark_runs_in_process(tmp_path, capsys):
  """Every method, operation, report and target at a tiny size, in this process."""
  results = many_arrays.main(["--counts", "6,12", "--repeats", "1", "--warm-runs", "1",
                              "--model-blocks", "1", "--model-rounds", "2", "--in-process", "--dir", str(tmp_path)])
  assert set(results["counts"]) == {6, 12}
  for summary in results["counts"].values():
    assert {method: set(ops) for method, ops in summary.items()} == {
        method: set(ops) for method, ops in many_arrays.OPERATIONS.items()}
    assert all(entry["fresh"][0] > 0 and entry["warm"][0] > 0
               for ops in summary.values() for entry in ops.values())
  assert results["model"]["arrays"] > 1
  assert set(many_arrays.MODEL_OPERATIONS) <= set(results["model"])
  printed = capsys.readouterr().out
  assert "12 arrays: pz_persist's speed relative to each method" in printed
  assert "How the cost per array grows with the count" in printed
  assert "1-block unstacked transformer" in printed
  assert "Issue 19's targets" in printed and "load_model adds over loading the arrays" in printed
  assert "taking turns in one warm process (2 rounds)" in printed
  assert "Issue 31's targets" in printed and "Issue 31: the manifest of 12 arrays" in printed
  assert set(results["floors"]) == {6, 12} and results["floors"][12]["format_version"] == 4
  assert "beyond the parameters'" in printed


def test_many_arrays_benchmark_runs_in_fresh_processes(tmp_path, capsys):
  """The workers' command line: one method, no model section, no repeats."""
  results = many_arrays.main(["--counts", "8", "--repeats", "1", "--methods", "safetensors",
                              "--skip", "warm,model", "--dir", str(tmp_path)])
  (summary,) = results["counts"].values()
  assert set(summary["safetensors"]) == {"save", "load"}
  assert all("warm" not in entry for entry in summary["safetensors"].values())
  assert "8 arrays (128.00 KiB)" in capsys.readouterr().out


def test_per_array_floors_benchmark_runs(tmp_path, capsys):
  results = per_array_floors.main(["--count", "20", "--repeats", "1", "--dir", str(tmp_path)])
  collector = "cyclic garbage collector inside the fastest load"
  assert results[collector] >= 0  # A load of 20 arrays may not collect at all.
  assert all(seconds > 0 for name, seconds in results.items() if name != collector)
  assert {"inspect", "json.loads (C parser, no checks)", "load", "ts.open of every array",
          "KvStore.read of every chunk (one batch)", "reader.read_arrays (read, verify, place)",
          "Penzai constructors (pz.Parameter + NamedArray)", "save"} <= set(results)
  assert "Whole operations and their parts" in capsys.readouterr().out


@pytest.mark.slow
def test_many_arrays_benchmark_full(tmp_path):
  results = many_arrays.main(["--dir", str(tmp_path)])
  assert set(results["counts"]) == {1000, 4000, 16000}


def test_sharded_restore_benchmark_runs(tmp_path, capsys):
  results = sharded_restore.main(["--sizes", "8MiB", "--processes", "2", "--dir", str(tmp_path)])
  (run,) = results["runs"]
  for method in sharded_restore.METHODS:
    assert [r["process"] for r in run[method]] == [0, 1]
    assert all(r["extra_rss"] >= 0 and r["shard_bytes"] > 0 for r in run[method])
  assert "peak RSS above baseline per process" in capsys.readouterr().out


def test_integrity_benchmark_runs(tmp_path, capsys):
  results = integrity.main(["--size", "4MiB", "--rounds", "2", "--dir", str(tmp_path)])
  assert set(results["loads"]) == set(integrity.LOADS)
  assert results["saves"]["hash_arrays"] > 0 and results["verify"]["seconds"] > 0
  assert "verification on load costs" in capsys.readouterr().out


@pytest.mark.slow
def test_integrity_benchmark_1gib(tmp_path):
  results = integrity.main(["--size", "1GiB", "--dir", str(tmp_path)])
  assert results["verify"]["seconds"] > 0


@pytest.mark.slow
def test_sharded_restore_benchmark_full(tmp_path):
  results = sharded_restore.main(["--dir", str(tmp_path)])
  assert results["fit"]["slope"] > 0


def _pretrained_benchmark():
  """benchmarks/pretrained.py, imported by path: ``pretrained`` is also the
  name of the tests/pretrained package."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  spec = importlib.util.spec_from_file_location(
      "pretrained_benchmark", os.path.join(REPO, "benchmarks", "pretrained.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_pretrained_benchmark_runs(tmp_path, capsys):
  bench = _pretrained_benchmark()
  results = bench.main(["--size", "2MiB", "--ops", "fresh_memory,load_hf,reload,reload_bf16",
                        "--dir", str(tmp_path)])
  assert set(results["ops"]) == {"fresh_memory", "load_hf", "convert", "reload",
                                 "convert_bf16", "reload_bf16"}
  assert all(entry["seconds"] > 0 for entry in results["ops"].values())
  assert results["model_bytes"] >= 2 * 2**20
  printed = capsys.readouterr().out
  assert "native reload speedup over load_hf" in printed and "peak RSS / model bytes" in printed
  assert "only allocating fresh memory" in printed
  assert results["reload_bf16_rss_ratio"] > 0


@pytest.mark.slow
def test_pretrained_benchmark_1gib(tmp_path):
  results = _pretrained_benchmark().main(["--size", "1GiB", "--dir", str(tmp_path)])
  assert results["reload_speedup"] > 0


def test_pretrained_benchmark_writes_llama3_rope_scaling(tmp_path):
  """``--rope-scaling llama3`` writes a checkpoint load_hf builds with scaled RoPE."""
  from penzai import pz  # pylint: disable=import-outside-toplevel

  import pz_persist as pzp  # pylint: disable=import-outside-toplevel
  from pz_persist.nn import scaled_rope  # pylint: disable=import-outside-toplevel

  _pretrained_benchmark().write_llama(str(tmp_path), 2**16, shards=1, rope_scaling="llama3")
  model = pzp.pretrained.load_hf(tmp_path)
  layers = pz.select(model).at_instances_of(scaled_rope.ApplyScaledRoPE).get_sequence()
  assert layers and {layer.rope_type for layer in layers} == {"llama3"}
  assert {layer.max_wavelength for layer in layers} == {500_000.0}


def _load_moe_benchmark():
  import importlib.util  # pylint: disable=import-outside-toplevel

  spec = importlib.util.spec_from_file_location(
      "load_moe_benchmark", os.path.join(REPO, "benchmarks", "load_moe.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_load_moe_benchmark_runs(tmp_path, capsys):
  """A tiny run: every operation measured in its own process, and the
  ratios against reading the safetensors alone printed."""
  results = _load_moe_benchmark().main([
      "--experts", "4", "--layers", "2", "--hidden", "16", "--neurons", "8", "--repeats", "2",
      "--dir", str(tmp_path)])
  assert set(results["ops"]) == {"safetensors_numpy", "safe_open", "headers", "skeleton",
                                 "bind", "load_hf"}
  assert results["floor_warm"] > results["ops"]["safetensors_numpy"]["warm"]
  assert results["tensors"] == 3 + 2 * (9 + 3 * 4)
  assert all(entry["fresh"] > 0 and entry["warm"] > 0 for entry in results["ops"].values())
  assert results["ratio_safetensors_numpy_warm"] > 0
  printed = capsys.readouterr().out
  assert "load_hf / safetensors_numpy (warm)" in printed
  assert "sum of the floors (warm)" in printed


@pytest.mark.slow
def test_load_moe_benchmark_128_experts_48_layers(tmp_path):
  results = _load_moe_benchmark().main(["--dir", str(tmp_path)])
  assert results["tensors"] == 3 + 48 * (9 + 3 * 128)
  assert results["ratio_safetensors_numpy_warm"] > 0


def test_lazy_open_benchmark_runs(tmp_path, capsys):
  results = lazy_open.main(["--size", "12MiB", "--layers", "2", "--warm-runs", "1",
                            "--dir", str(tmp_path)])
  assert set(results["runs"]) == {f"{side}/{op}" for side, op in lazy_open.RUNS}
  assert all(run["fresh"] > 0 for run in results["runs"].values())
  assert results["data"]["layer_bytes"] < results["data"]["bytes"]
  printed = capsys.readouterr().out
  assert "pz_persist layer / floor layer" in printed and "pz_persist layer / orbax layer" in printed


@pytest.mark.slow
def test_lazy_open_benchmark_2gib(tmp_path):
  results = lazy_open.main(["--size", "2GiB", "--dir", str(tmp_path)])
  assert results["data"]["bytes"] >= 2**30
