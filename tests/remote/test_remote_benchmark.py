"""benchmarks/remote.py keeps working: its counting proxy forwards and counts
(default), and a tiny run of the whole benchmark completes (``-m slow``)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from conftest import REPO
from conftest import run_python
from etils import epath

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import request_counter  # noqa: E402  pylint: disable=wrong-import-position


def _load_benchmark():
  """benchmarks/remote.py, by path: ``remote`` is this test package's name."""
  spec = importlib.util.spec_from_file_location(
      "remote_benchmark", os.path.join(REPO, "benchmarks", "remote.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


remote_benchmark = _load_benchmark()


@pytest.mark.parametrize("method, target, kind, name", [
    ("POST", "/upload/storage/v1/b/pz-test/o?uploadType=multipart&name=ab12cd34ef56%2Fck%2Fgen-"
     "0123456789abcdef%2Fpenzai%2Fpz_persist.json", "upload", "ck/gen-*/penzai/pz_persist.json"),
    ("GET", "/storage/v1/b/pz-test/o?prefix=ab12cd34ef56%2Fck%2F&delimiter=%2F", "list", "ck/"),
    ("GET", "/storage/v1/b/pz-test/o/ab12cd34ef56%2Fck%2Fd%2F0a1b2c3d4e5f6a7b?alt=media", "read",
     "ck/d/*"),
    ("DELETE", "/storage/v1/b/pz-test/o/ab12cd34ef56%2Fck", "delete", "ck"),
    ("PUT", "/pz-test/ab12cd34ef56/ck/pz_persist.commit.00000000000000000001", "upload",
     "ck/pz_persist.commit.*"),
    ("HEAD", "/pz-test/ab12cd34ef56/ck/_METADATA", "metadata", "ck/_METADATA"),
    ("GET", "/pz-test?list-type=2&prefix=ab12cd34ef56%2Fck%2F", "list", "ck/"),
    ("POST", "/pz-test/ab12cd34ef56/ck/d/ff00ff00ff00?uploads", "multipart", "ck/d/*"),
])
def test_requests_are_classed_by_what_they_do(method, target, kind, name):
  assert request_counter.path_class(method, target, {}) == (kind, name)


def test_the_proxy_forwards_and_counts(remote, store):
  proxy_url, counter, stop = request_counter.start(store.url)
  try:
    env = remote_benchmark.proxied_env(store.scheme, store.env, proxy_url)
    code = (f"from etils import epath; p = epath.Path({remote + '/x'!r}); p.write_bytes(b'abc');"
            " assert p.read_bytes() == b'abc'")
    run_python(code, timeout=120, env=env)
    seen = request_counter.counts(proxy_url)
    assert seen["total"] >= 2 and seen["bytes_up"] >= 3, seen
    assert any(kind.endswith("read") for kind in seen["by_kind"]), seen
  finally:
    stop()
  assert counter.snapshot()["total"] == seen["total"]
  assert epath.Path(remote + "/x").read_bytes() == b"abc"  # Written through to the store.


@pytest.mark.slow
def test_tiny_run_measures_every_row(capsys):
  results = remote_benchmark.main(["--size", "1MiB", "--arrays", "4", "--stores", "gs",
                                   "--repeats", "1"])
  rows = results["stores"]["gs"]
  assert set(rows) == set(remote_benchmark.ROWS)
  for entry in rows.values():
    assert "error" not in entry, entry
    assert entry["requests"]["total"] > 0 and entry["seconds"] > 0
  assert "pz_persist / plain Orbax" in capsys.readouterr().out
