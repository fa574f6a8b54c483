"""JSON from a checkpoint is parsed with bounded memory and nesting.

Every JSON file pz_persist reads (the manifest, the file digest list, Orbax's
``_CHECKPOINT_METADATA``, and Orbax's ``_METADATA`` before Orbax parses it)
goes through `pz_persist.safety.bounded_json`. A node bomb (``[{},{},...]``, 25 bytes
of memory per byte once parsed) or deep nesting is refused before any parser
sees it, naming the file. Memory is measured with tracemalloc (which NumPy
reports to) in a fresh interpreter, so an unbounded parse cannot take down
the test run.
"""

from __future__ import annotations

import json
import random

import model_zoo
import pytest
from conftest import run_python

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import bounded_json

BOMB_ITEMS = 6_000_000
"""``{}`` items of a 18 MB bomb: ~450 MB of Python objects once parsed."""


def _measure(setup: str, call: str) -> str:
  """Runs ``call`` after ``setup`` in a fresh interpreter; returns its error
  and the peak traced memory (bytes) during the call, as ``error|peak``."""
  return run_python(f"""
import tracemalloc
import pz_persist as pzp
from pz_persist import errors
{setup}
tracemalloc.start()
try:
  {call}
  outcome = "no error"
except errors.PzPersistError as e:
  outcome = str(e)
peak = tracemalloc.get_traced_memory()[1]
print(outcome.replace("|", "/") + "|" + str(peak))
""", timeout=300).strip()


def _bomb(prefix: str, suffix: str) -> str:
  return f"{prefix!r}.encode() + b'{{}},' * {BOMB_ITEMS} + b'{{}}' + {suffix!r}.encode()"


@pytest.fixture
def ckpt(ckpt):
  """A saved checkpoint (of the MLP of `model_zoo`)."""
  pzp.save_model(ckpt, model_zoo.mlp())
  return ckpt


def test_manifest_node_bomb_is_refused_before_parsing(ckpt):
  manifest = ckpt / "penzai" / "pz_persist.json"
  data = _bomb(
      '{"format":"pz_persist","format_version":2,"writer":"x","variables":[],'
      '"arrays":[],"tree":[', "]}"
  )
  outcome, peak = _measure(
      f"open({str(manifest)!r}, 'wb').write({data})",
      f"pzp.inspect({str(ckpt)!r})",
  ).rsplit("|", 1)
  assert "pz_persist.json: " in outcome and "JSON values" in outcome, outcome
  size = manifest.stat().st_size
  # The file itself, and the scan's fixed-size chunks: not the parse's ~25x.
  assert int(peak) < size + 64 * 2**20, (peak, size)


def test_file_digest_node_bomb_is_refused_before_parsing(ckpt):
  digests = ckpt / "penzai" / "pz_persist.files.json"
  data = _bomb(
      '{"format":"pz_persist.files","algorithm":"xxh3_128","files":{},"x":[', "]}"
  )
  outcome, peak = _measure(
      f"open({str(digests)!r}, 'wb').write({data})",
      f"raise errors.PzPersistError(str(pzp.verify({str(ckpt)!r})))",
  ).rsplit("|", 1)
  assert "pz_persist.files.json: " in outcome and "JSON values" in outcome, outcome
  assert int(peak) < digests.stat().st_size * 2 + 64 * 2**20, peak


def test_checkpoint_metadata_node_bomb_is_refused_before_parsing(ckpt):
  metadata = ckpt / "_CHECKPOINT_METADATA"
  outcome, peak = _measure(
      f"open({str(metadata)!r}, 'wb').write({_bomb('[', ']')})",
      # What pzp.load calls first (loading allocates hundreds of MiB itself).
      f"from pz_persist.storage.integrity import containment; containment.check_checkpoint_metadata({str(ckpt)!r})",
  ).rsplit("|", 1)
  assert "_CHECKPOINT_METADATA" in outcome, outcome
  with pytest.raises(errors.ManifestError, match="ckpt/_CHECKPOINT_METADATA: "):
    pzp.load(ckpt)
  assert int(peak) < metadata.stat().st_size + 64 * 2**20, peak


def test_orbax_metadata_node_bomb_is_refused_before_orbax_parses_it(ckpt):
  metadata = ckpt / "penzai" / "_METADATA"
  data = _bomb('{"tree_metadata":[', "]}")
  outcome, peak = _measure(
      f"open({str(metadata)!r}, 'wb').write({data})",
      # What pzp.load calls before Orbax parses it (loading allocates
      # hundreds of MiB itself).
      f"from pz_persist.safety import bounded_json;"
      f" bounded_json.check_orbax_metadata({str(ckpt / 'penzai')!r})",
  ).rsplit("|", 1)
  assert "_METADATA: " in outcome and "JSON values" in outcome, outcome
  for load in (pzp.load, pzp.load_model):
    with pytest.raises(errors.ManifestError, match=r"penzai/_METADATA: \d+ JSON values"):
      load(ckpt)
  assert int(peak) < metadata.stat().st_size + 64 * 2**20, peak


@pytest.mark.parametrize("name", ["penzai/pz_persist.json", "penzai/_METADATA"])
def test_deep_nesting_is_refused_even_with_a_huge_recursion_limit(ckpt, name):
  # With the interpreter's recursion limit raised, a parser recursing once
  # per level overflows the C stack and kills the process.
  path = ckpt / name
  outcome = run_python(f"""
import sys
import pz_persist as pzp
from pz_persist import errors
open({str(path)!r}, "wb").write(b"[    " * 2_000_000 + b"]" * 2_000_000)
sys.setrecursionlimit(10**8)
try:
  pzp.load({str(ckpt)!r})
except errors.PzPersistError as e:
  print(e)
""", timeout=300)
  assert f"{name}: JSON nested 2000000 levels deep" in outcome, outcome


def test_real_manifests_are_far_from_the_limits(ckpt):
  data = (ckpt / "penzai" / "pz_persist.json").read_bytes()
  counts = bounded_json.scan(data)
  assert counts.values * 4 < manifest_lib.MAX_MANIFEST_NODES
  assert counts.objects * manifest_lib.MIN_BYTES_PER_OBJECT * 1.5 < len(data)
  assert counts.depth * 4 < manifest_lib.MAX_JSON_DEPTH


def _exact(value) -> tuple[int, int]:
  """Values (and keys) of parsed JSON, and the depth of its containers."""
  if isinstance(value, (list, dict)):
    children = list(value.values()) if isinstance(value, dict) else value
    counts = [_exact(child) for child in children]
    keys = len(value) if isinstance(value, dict) else 0
    return (
        1 + keys + sum(n for n, _ in counts),
        1 + max((d for _, d in counts), default=0),
    )
  return 1, 0


def _random_json(rng: random.Random, depth: int = 0):
  tricky = ['"', "\\", '\\"', "[{,:", "]}", "\\\\", 'a\\"]]', "\u2028", "é"]
  roll = rng.random()
  if depth > 6 or roll < 0.3:
    return rng.choice([1, 2.5, None, True, rng.choice(tricky) * rng.randint(0, 3)])
  if roll < 0.65:
    return [_random_json(rng, depth + 1) for _ in range(rng.randint(1, 4))]
  return {rng.choice(tricky) + str(i): _random_json(rng, depth + 1)
          for i in range(rng.randint(1, 4))}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 18])
def test_structure_counts_exactly_across_chunk_boundaries(monkeypatch, chunk):
  # Quotes, backslashes and brackets inside strings, split anywhere.
  monkeypatch.setattr(bounded_json, "_CHUNK", chunk)
  rng = random.Random(chunk)
  for _ in range(200):
    value = _random_json(rng)
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
    assert bounded_json.structure(text) == _exact(value), text


def test_duplicate_keys_are_refused():
  with pytest.raises(errors.ManifestError, match=r"f\.json: not valid JSON: duplicate"):
    bounded_json.loads(b'{"a": 1, "a": 2}', where="f.json", max_nodes=99, max_depth=9)


def test_a_json_file_is_read_within_every_limit(tmp_path):
  """As readers of a checkpoint's JSON files do: its size bounded by
  `read_file`, then its values and nesting by `loads`."""
  path = tmp_path / "config.json"

  def load(max_bytes=100, max_nodes=10, max_depth=2):
    data = bounded_json.read_file(path, max_bytes=max_bytes)
    most = bounded_json.node_limit(len(data), most=max_nodes)
    return bounded_json.loads(data, where=str(path), max_nodes=most, max_depth=max_depth)

  path.write_bytes(b'{"a": [1, 2]}')
  assert load() == {"a": [1, 2]}
  path.write_bytes(b"[" + b" " * 200 + b"]")
  with pytest.raises(errors.ManifestError, match="config.json: over the 100-byte limit"):
    load()
  path.write_bytes(b"[[[1]]]")
  with pytest.raises(errors.ManifestError, match="config.json: JSON nested 3 levels"):
    load()
  path.write_bytes(b"[" + b"0," * 5000 + b"0]")
  with pytest.raises(errors.ManifestError, match=r"config.json: 5002 JSON values"):
    load(max_bytes=10**6, max_nodes=100)


def test_reading_small_json_files_allocates_no_size_limit(ckpt):
  # `f.read(limit + 1)` allocates the limit (256 MiB for a manifest) up front,
  # whatever the file's size: a tiny load must stay tiny.
  outcome, peak = _measure("", f"pzp.load({str(ckpt)!r}); pzp.verify({str(ckpt)!r})").rsplit("|", 1)
  assert outcome == "no error"
  assert int(peak) < 32 * 2**20, peak


def _with_a_repeated_key(rng: random.Random, value):
  """``value`` as JSON text with one key of one of its objects repeated."""
  objects = []

  def collect(v):
    if isinstance(v, dict):
      objects.append(v)
    for child in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()):
      collect(child)

  collect(value)
  if not objects:
    return None
  target = rng.choice(objects)
  key = rng.choice(list(target))
  target["\ue000"] = 0  # A placeholder pair, then replaced by the repeated pair.
  text = json.dumps(value).replace('"\\ue000": 0', json.dumps({key: target[key]})[1:-1])
  del target["\ue000"]
  return text.encode()


def test_repeated_keys_are_refused_anywhere_whatever_the_strings_hold():
  # Duplicate keys are found by counting the keys the text holds (the ':'
  # outside strings) against those parsed: strings full of quotes, colons
  # and backslashes must neither hide a repeated key nor invent one.
  rng = random.Random(7)
  refused = 0
  for _ in range(300):
    value = _random_json(rng)
    text = json.dumps(value).encode()
    assert bounded_json.loads(text, where="f", max_nodes=10**6, max_depth=99) == value
    repeated = _with_a_repeated_key(rng, value)
    if repeated is not None:
      with pytest.raises(errors.ManifestError, match="f: not valid JSON: duplicate object key"):
        bounded_json.loads(repeated, where="f", max_nodes=10**6, max_depth=99)
      refused += 1
  assert refused > 50
