"""A catalogue of hostile checkpoints: malformed, damaged or malicious.

Each case is a small builder that takes a fresh, valid checkpoint (the MLP of
`model_zoo`, saved with `pzp.save_model`) and damages it, with the pz_persist
error loading it must raise and a regex its message must match: the message
has to name the file, label or tree path at fault. `test_catalogue.py` runs
every case through every way of loading (``pzp.load``, ``pzp.inspect``,
``pzp.load_model``, ``pzp.load_into(path, model)``, and lazily:
``pzp.open`` then the handle's ``load()``, which must refuse whatever
``pzp.load`` refuses, and ``pzp.open`` then ``handle[label]`` and
``handle.read(label, index)`` of every variable, each of which must read or
refuse with a pz_persist error).

``entry_points`` says which of those must refuse the case. Elsewhere the case
may be harmless (``inspect`` reads no array file; binding into a model reads
only the variables it needs, not the tree's structure): there the load must
either succeed or raise a pz_persist error, and never change the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from collections.abc import Callable

import manifest_json
import pytest

from pz_persist import errors
from pz_persist import safety
from pz_persist.format import encode
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage.integrity import file_digests

LOAD, INSPECT, LOAD_MODEL, INTO = "load", "inspect", "load_model", "into"
LAZY = "open"  # pzp.open(path).load(): refuses every case LOAD refuses.
LAZY_PARTS = "open_parts"  # pzp.open(path)[label] and .read: read or refuse.
ALL = frozenset({LOAD, INSPECT, LOAD_MODEL, INTO})
READING = frozenset({LOAD, LOAD_MODEL, INTO})  # Cases about the array files.
DECODING = frozenset({LOAD, INSPECT, LOAD_MODEL})  # Cases about the tree.

Builder = Callable[[pathlib.Path, pytest.MonkeyPatch], None]

LABEL0 = "mlp/Affine_0/Linear.weights"  # arrays[0] and variables[0]: [8, 16].
LABEL0_RE = r"mlp/Affine_0/Linear\.weights"
DAMAGED = (errors.ManifestError, errors.IntegrityError)


@dataclasses.dataclass(frozen=True)
class Case:
  """One hostile checkpoint.

  Attributes:
    name: Test id.
    build: Damages the valid checkpoint at its first argument.
    error: The pz_persist error (or errors) loading must raise.
    match: Regex the message must match (``re.search``).
    entry_points: Which loaders must raise it (see the module docstring).
    unimported: A module the checkpoint names that must not get imported.
  """

  name: str
  build: Builder
  error: type[Exception] | tuple[type[Exception], ...]
  match: str
  entry_points: frozenset[str] = ALL
  unimported: str | None = None


# Helpers.


def item(ckpt: pathlib.Path) -> pathlib.Path:
  return ckpt / "penzai"


def manifest_file(ckpt: pathlib.Path) -> pathlib.Path:
  return item(ckpt) / manifest_lib.MANIFEST_FILENAME


def outside(ckpt: pathlib.Path) -> pathlib.Path:
  """A directory beside (not inside) the checkpoint."""
  path = ckpt.parent / "outside"
  path.mkdir(exist_ok=True)
  return path


def read_manifest(ckpt: pathlib.Path) -> dict:
  return manifest_json.read(manifest_file(ckpt))


def write_manifest(ckpt: pathlib.Path, data: dict) -> None:
  manifest_file(ckpt).write_text(json.dumps(data, allow_nan=True))


def edit(fn: Callable[[dict], object]) -> Builder:
  """A builder applying ``fn`` to the parsed manifest."""

  def build(ckpt, monkeypatch):
    del monkeypatch
    data = read_manifest(ckpt)
    fn(data)
    write_manifest(ckpt, data)

  return build


def as_format_1(fn: Callable[[dict], object]) -> Builder:
  """``edit(fn)`` of a manifest rewritten as format 1 (which has no
  checksums), with the file digest list format-1 writers did not write
  either: a forgery that looks like a checkpoint from before checksums, so
  only what ``fn`` changes is hostile."""

  def build(ckpt, monkeypatch):
    def forged(m):
      for entry in m["arrays"]:
        entry.pop("checksums", None)
      m["format_version"] = 1
      fn(m)

    edit(forged)(ckpt, monkeypatch)
    (item(ckpt) / manifest_lib.FILE_DIGESTS_FILENAME).unlink(missing_ok=True)

  return build


def edit_array(index: int, **fields) -> Builder:
  """Changes fields of one array entry (as format 1, see `as_format_1`)."""
  return as_format_1(lambda m: m["arrays"][index].update(fields))


def set_shape(index: int, shape: list) -> Builder:
  """Declares another shape for variable ``index``'s array, consistently in
  the arrays table and the NamedArray's axes, so only the sizes are hostile."""

  def fn(m):
    m["arrays"][index]["shape"] = shape
    axes = m["variables"][index]["value"]["axes"]
    for pair, size in zip(axes, shape[-len(axes):]):
      pair[1] = size

  return as_format_1(fn)


def edit4(fn: Callable[[dict], object]) -> Builder:
  """A builder applying ``fn`` to the manifest as written (format 4's
  compact layout, `pz_persist.format.compact`), not to its expanded form."""

  def build(ckpt, monkeypatch):
    del monkeypatch
    data = json.loads(manifest_file(ckpt).read_text())
    assert data["format_version"] == 4, "the valid checkpoint is format 4"
    fn(data)
    manifest_file(ckpt).write_text(json.dumps(data))

  return build


def _set(path: tuple, value) -> Callable[[dict], None]:
  """``data[path[0]][path[1]]... = value``."""
  def fn(data):
    for key in path[:-1]:
      data = data[key]
    data[path[-1]] = value
  return fn


def _nested(depth: int) -> list:
  """A list node (type 1 of the MLP's manifest) nested ``depth`` deep."""
  node: list = [1, []]
  for _ in range(depth):
    node = [1, [node]]
  return node


def raw(transform: Callable[[bytes], bytes]) -> Builder:
  """A builder rewriting the manifest's bytes."""

  def build(ckpt, monkeypatch):
    del monkeypatch
    path = manifest_file(ckpt)
    path.write_bytes(transform(path.read_bytes()))

  return build


def set_fn(module: str, qualname: str) -> Builder:
  """Makes the Elementwise layer (``tree.sublayers[1].fn``) name a function."""

  def fn(m):
    layer = m["tree"]["fields"][0][1]["items"][1]
    assert layer["class"]["qualname"] == "Elementwise"
    layer["fields"][0][1] = {"t": "function", "ref": {"module": module, "qualname": qualname}}

  return edit(fn)


def set_class(index: int, module: str, qualname: str) -> Builder:
  """Makes layer ``tree.sublayers[index]`` claim another class."""

  def fn(m):
    m["tree"]["fields"][0][1]["items"][index]["class"] = {
        "module": module, "qualname": qualname,
    }

  return edit(fn)


def data_files(ckpt: pathlib.Path) -> list[pathlib.Path]:
  """The array data files Orbax reads (the merged OCDBT database's)."""
  files = sorted((item(ckpt) / "d").iterdir(), key=lambda p: p.stat().st_size)
  assert files
  return files


def damage_data(transform: Callable[[bytes], bytes]) -> Builder:
  def build(ckpt, monkeypatch):
    del monkeypatch
    for path in data_files(ckpt):
      path.write_bytes(transform(path.read_bytes()))

  return build


def flip_middle(data: bytes) -> bytes:
  out = bytearray(data)
  for i in range(len(out) // 2, min(len(out), len(out) // 2 + 8)):
    out[i] ^= 0xFF
  return bytes(out)


def set_zarray_shape(shape: list[int], field: str = "shape") -> Builder:
  """Rewrites TensorStore's metadata of arrays[0] inside the OCDBT database:
  Orbax's own metadata then declares ``shape`` (or, with ``field="chunks"``,
  chunks of that shape) for a file of a few bytes."""

  def build(ckpt, monkeypatch):
    del monkeypatch
    import tensorstore as ts  # pylint: disable=g-import-not-at-top

    kv = ts.KvStore.open(
        {"driver": "ocdbt", "base": f"file://{item(ckpt)}/"}
    ).result()
    key = next(k for k in kv.list().result() if k.startswith(b"00000_") and k.endswith(b"/.zarray"))
    meta = json.loads(kv.read(key).result().value)
    meta[field] = shape
    kv.write(key, json.dumps(meta).encode()).result()

  return build


def _array0_store(ckpt: pathlib.Path):
  """The item's OCDBT key-value store, and the keys of arrays[0]'s
  ``.zarray`` and chunk in it ([8, 16] float32: one raw chunk, ``0.0``)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item(ckpt)}/"}).result()
  zarray = next(k for k in kv.list().result() if k.startswith(b"00000_") and k.endswith(b"/.zarray"))
  return kv, zarray, zarray[: -len(b".zarray")] + b"0.0"


def lie_in_zarray(**fields) -> Builder:
  """Rewrites arrays[0]'s ``.zarray`` with ``fields`` changed, in the very
  form TensorStore writes (compact, keys sorted), so that only its content
  differs from what the raw-chunk read (`pz_persist.storage.reading.raw_chunks`)
  accepts byte for byte."""

  def build(ckpt, monkeypatch):
    del monkeypatch
    kv, key, _ = _array0_store(ckpt)
    meta = json.loads(kv.read(key).result().value)
    meta.update(fields)
    kv.write(key, json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).result()

  return build


def change_chunk(transform: Callable[[bytes], bytes | None]) -> Builder:
  """Rewrites arrays[0]'s chunk (its raw bytes) as ``transform`` returns it;
  None deletes it."""

  def build(ckpt, monkeypatch):
    del monkeypatch
    kv, _, key = _array0_store(ckpt)
    data = transform(kv.read(key).result().value)
    if data is None:
      kv.delete_range(ts_range(key)).result()
    else:
      kv.write(key, data).result()

  return build


def ts_range(key: bytes):
  """The key range of exactly ``key``."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  return ts.KvStore.KeyRange(key, key + b"\x00")


def both(*builders: Builder) -> Builder:
  def build(ckpt, monkeypatch):
    for b in builders:
      b(ckpt, monkeypatch)

  return build


def nested_lists(depth: int) -> dict:
  node = {"t": "none"}
  for _ in range(depth):
    node = {"t": "list", "items": [node]}
  return node


# Builders that do more than edit JSON.


def write_file(relative: str, data: bytes) -> Builder:
  """A builder replacing a file of the checkpoint with ``data``."""

  def build(ckpt, monkeypatch):
    del monkeypatch
    (ckpt / relative).write_bytes(data)

  return build


def manifest_missing(ckpt, monkeypatch):
  manifest_file(ckpt).unlink()


def manifest_is_directory(ckpt, monkeypatch):
  manifest_file(ckpt).unlink()
  manifest_file(ckpt).mkdir()


def manifest_fifo(ckpt, monkeypatch):
  manifest_file(ckpt).unlink()
  os.mkfifo(manifest_file(ckpt))


def manifest_symlink(target: str) -> Builder:
  def build(ckpt, monkeypatch):
    manifest_file(ckpt).unlink()
    manifest_file(ckpt).symlink_to(target)

  return build


def manifest_symlink_outside(ckpt, monkeypatch):
  copy = outside(ckpt) / "pz_persist.json"
  shutil.copy(manifest_file(ckpt), copy)
  manifest_file(ckpt).unlink()
  manifest_file(ckpt).symlink_to(copy)


def manifest_over_limit(ckpt, monkeypatch):
  monkeypatch.setattr(manifest_lib, "MAX_MANIFEST_BYTES", 1000)


def allocation_over_limit(ckpt, monkeypatch):
  monkeypatch.setattr(safety, "MAX_ALLOCATION_BYTES", 64)


def deep_json(ckpt, monkeypatch):
  depth = 100_000
  text = manifest_file(ckpt).read_text()
  nested = '{"t":"list","items":[' * depth + '{"t":"none"}' + "]}" * depth
  start = text.index('"tree":') + len('"tree":')
  end = text.index(',"variables":')
  manifest_file(ckpt).write_text(text[:start] + nested + text[end:])


def orbax_metadata_garbage(ckpt, monkeypatch):
  (item(ckpt) / "_METADATA").write_bytes(b"\x00garbage{")


def orbax_metadata_missing(ckpt, monkeypatch):
  (item(ckpt) / "_METADATA").unlink()


def checkpoint_metadata_garbage(ckpt, monkeypatch):
  (ckpt / "_CHECKPOINT_METADATA").write_bytes(b"not json at all")


def data_files_missing(ckpt, monkeypatch):
  for path in data_files(ckpt):
    path.unlink()


def ocdbt_manifest_missing(ckpt, monkeypatch):
  (item(ckpt) / "manifest.ocdbt").unlink()


def data_dir_symlink_outside(ckpt, monkeypatch):
  copy = outside(ckpt) / "d"
  shutil.copytree(item(ckpt) / "d", copy)
  shutil.rmtree(item(ckpt) / "d")
  (item(ckpt) / "d").symlink_to(copy)


def data_file_symlink_to_etc(ckpt, monkeypatch):
  path = data_files(ckpt)[-1]
  path.unlink()
  path.symlink_to("/etc/passwd")


def data_file_fifo(ckpt, monkeypatch):
  path = data_files(ckpt)[-1]
  path.unlink()
  os.mkfifo(path)


def item_symlink_outside(ckpt, monkeypatch):
  copy = outside(ckpt) / "penzai"
  shutil.copytree(item(ckpt), copy)
  shutil.rmtree(item(ckpt))
  item(ckpt).symlink_to(copy)


def duplicate_variable_labels(m):
  m["variables"][2]["label"] = m["variables"][0]["label"]


def control_char_label(m):
  m["variables"][0]["label"]["v"] = "mlp/\x00evil"
  m["arrays"][0]["label"] = "mlp/\x00evil"


def _variable0_axes(m):
  return m["variables"][0]["value"]["axes"]


def _elementwise(m):
  return m["tree"]["fields"][0][1]["items"][1]


def variable0_axes_beside_its_data(m):
  """Variable 0 as a NamedArray whose axes (8, 32) do not fit its [8, 16]
  array, in the form optimizer states legitimately use (a plain struct):
  loadable as a value, never bound into a model in place of a parameter."""
  import collections  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top
  from penzai import pz  # pylint: disable=g-import-not-at-top

  value = m["variables"][0]["value"]
  named_class = encode.encode(
      pz.nx.NamedArray(collections.OrderedDict(a=2), np.zeros(1))
  ).tree["class"]
  axes = [[name, {"t": "int", "v": size}] for (name, _), size in zip(value["axes"], (8, 32))]
  m["variables"][0]["value"] = {
      "t": "struct",
      "class": named_class,
      "fields": [
          ["named_axes", {"t": "ordered_dict", "items": axes}],
          ["data_array", value["data"]],
      ],
  }


def _fn(module: str, qualname: str) -> dict:
  return {"t": "function", "ref": {"module": module, "qualname": qualname}}


def _partial(func: dict, *args: dict) -> dict:
  return {"t": "partial", "func": func, "args": list(args), "keywords": []}


def set_fn_node(node: dict) -> Builder:
  """Makes the Elementwise layer (``tree.sublayers[1].fn``) hold ``node``."""
  return edit(lambda m: _elementwise(m)["fields"][0].__setitem__(1, node))


SETATTR = _fn("jax.scipy.stats", "gaussian_kde._setattr")
"""``object.__setattr__`` under a public class of an allowed module: as an
``Elementwise`` activation ``partial(SETATTR, obj, name)`` sets ``obj.name``
to the activations, process-wide."""

SHARED = {"t": "enum", "name": "SHARED",
          "class": {"module": "penzai.nn.layer_stack", "qualname": "LayerStackVarBehavior"}}

USER_MODULE = "pz_persist_hostile_reexports"
"""A module of the user's, allowed by the test, that imports from NumPy and
os what it does not define (`with_user_module`)."""


def with_user_module(build: Builder) -> Builder:
  """``build``, with `USER_MODULE` importable, imported and allowed (undone
  after the test by ``monkeypatch``)."""

  def builder(ckpt, monkeypatch):
    import importlib  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top

    from pz_persist.safety import allowlist  # pylint: disable=g-import-not-at-top

    folder = ckpt.parent / "user_code"
    folder.mkdir(exist_ok=True)
    (folder / f"{USER_MODULE}.py").write_text(
        "from numpy import memmap, save\nfrom os import system\nimport os\n"
        "class Holder:\n  writer = save\n  dump = staticmethod(save)\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setitem(sys.modules, USER_MODULE, importlib.import_module(USER_MODULE))
    monkeypatch.setattr(allowlist, "_globally_allowed", {USER_MODULE})
    build(ckpt, monkeypatch)

  return builder


MANIFEST_RE = r"penzai/pz_persist\.json"
ARRAY0_RE = rf"pz_persist\.json: arrays\[0\] \(label '{LABEL0_RE}'\)"
FN_RE = r"tree\.sublayers\[1\]\.fn"

CASES: list[Case] = [
    # The manifest file itself.
    Case("manifest_missing", manifest_missing, errors.NotACheckpointError,
         r"ckpt is not a pz_persist checkpoint: no pz_persist\.json"),
    Case("manifest_empty", raw(lambda b: b""), errors.ManifestError,
         MANIFEST_RE + ": not valid JSON"),
    Case("manifest_not_json", raw(lambda b: b"\x89PNG\r\n\x1a\n\x00\xff"),
         errors.ManifestError, MANIFEST_RE + ": not valid JSON"),
    Case("manifest_truncated", raw(lambda b: b[: len(b) // 2]), errors.ManifestError,
         MANIFEST_RE + ": not valid JSON"),
    Case("manifest_is_directory", manifest_is_directory, errors.ManifestError,
         MANIFEST_RE + " is a directory"),
    Case("manifest_fifo", manifest_fifo, errors.UnsafeCheckpointError,
         MANIFEST_RE + " is a FIFO"),
    Case("manifest_symlink_to_dev_zero", manifest_symlink("/dev/zero"),
         errors.UnsafeCheckpointError, MANIFEST_RE + " is a symlink to /dev/zero, outside"),
    Case("manifest_symlink_to_dev_urandom", manifest_symlink("/dev/urandom"),
         errors.UnsafeCheckpointError, MANIFEST_RE + " is a symlink to /dev/urandom"),
    Case("manifest_symlink_outside", manifest_symlink_outside,
         errors.UnsafeCheckpointError, MANIFEST_RE + r" is a symlink to .*outside/pz_persist\.json"),
    Case("manifest_over_size_limit", manifest_over_limit, errors.ManifestError,
         MANIFEST_RE + r": manifest is \d+ bytes, over the 1000-byte limit"),
    Case("manifest_is_a_list", raw(lambda b: b"[]"), errors.ManifestError,
         MANIFEST_RE + ": not a pz_persist manifest"),
    Case("manifest_missing_field", edit(lambda m: m.pop("tree")), errors.ManifestError,
         MANIFEST_RE + ": manifest fields"),
    Case("manifest_extra_field", edit(lambda m: m.update(code="import os")),
         errors.ManifestError, MANIFEST_RE + ": manifest fields"),
    Case("deeply_nested_json", deep_json, errors.ManifestError,
         MANIFEST_RE + ": JSON nested 200002 levels deep, over the limit"),
    # format_version.
    Case("format_version_newer", edit(lambda m: m.update(format_version=99)),
         errors.FormatVersionError, MANIFEST_RE + r" was written by .* format 99.*pip install -U"),
    Case("format_version_zero", edit(lambda m: m.update(format_version=0)),
         errors.ManifestError, MANIFEST_RE + ": invalid format_version 0"),
    Case("format_version_negative", edit(lambda m: m.update(format_version=-1)),
         errors.ManifestError, MANIFEST_RE + ": invalid format_version -1"),
    Case("format_version_string", edit(lambda m: m.update(format_version="1")),
         errors.ManifestError, MANIFEST_RE + ": invalid format_version '1'"),
    Case("format_version_float", edit(lambda m: m.update(format_version=1.0)),
         errors.ManifestError, MANIFEST_RE + r": invalid format_version 1\.0"),
    Case("format_version_bool", edit(lambda m: m.update(format_version=True)),
         errors.ManifestError, MANIFEST_RE + ": invalid format_version True"),
    # Wrong JSON types at the top.
    Case("tree_is_a_list", edit(lambda m: m.update(tree=[])), errors.ManifestError,
         MANIFEST_RE + ": tree must be an object"),
    Case("arrays_is_a_dict", edit(lambda m: m.update(arrays={})), errors.ManifestError,
         MANIFEST_RE + ": arrays must be a list"),
    Case("variables_is_a_dict", edit(lambda m: m.update(variables={})),
         errors.ManifestError, MANIFEST_RE + ": tree must be an object, variables a list"),
    Case("writer_is_an_int", edit(lambda m: m.update(writer=7)), errors.ManifestError,
         MANIFEST_RE + ": arrays must be a list, writer a string"),
    # Array entries.
    Case("shape_is_a_string", edit_array(0, shape="8,16"), errors.ManifestError,
         ARRAY0_RE + ": invalid shape '8,16'"),
    Case("shape_holds_a_float", edit_array(0, shape=[8.0, 16]), errors.ManifestError,
         ARRAY0_RE + r": invalid shape \[8\.0, 16\]"),
    Case("shape_holds_a_bool", edit_array(0, shape=[True, 16]), errors.ManifestError,
         ARRAY0_RE + r": invalid shape \[True, 16\]"),
    Case("shape_negative", edit_array(0, shape=[-8, 16]), errors.ManifestError,
         ARRAY0_RE + r": invalid shape \[-8, 16\]"),
    Case("shape_nan", raw(lambda b: b.replace(b'[8,16]', b'[NaN,16]', 1)),
         errors.ManifestError, MANIFEST_RE + ": not valid JSON.*NaN"),
    Case("shape_infinity",
         raw(lambda b: b.replace(b'[8,16]', b'[Infinity,16]', 1)),
         errors.ManifestError, MANIFEST_RE + ": not valid JSON.*Infinity"),
    Case("shape_rank_over_limit", edit_array(0, shape=[1] * 100), errors.ManifestError,
         ARRAY0_RE + ": 100 dimensions"),
    Case("dtype_is_an_int", edit_array(0, dtype=5), errors.ManifestError,
         ARRAY0_RE + ": unknown dtype 5"),
    Case("dtype_is_object", edit_array(0, dtype="object"), errors.ManifestError,
         ARRAY0_RE + ": unknown dtype 'object'"),
    Case("array_entry_extra_field", edit_array(0, pickle="gASV"), errors.ManifestError,
         ARRAY0_RE + ": array entry has fields"),
    Case("key_with_dotdot", edit_array(0, key="../../../etc/passwd"), errors.ManifestError,
         ARRAY0_RE + r": invalid array key '\.\./\.\./\.\./etc/passwd'"),
    Case("key_with_slash", edit_array(0, key="00000/x"), errors.ManifestError,
         ARRAY0_RE + ": invalid array key '00000/x'"),
    Case("key_absolute", edit_array(0, key="/etc/passwd"), errors.ManifestError,
         ARRAY0_RE + ": invalid array key '/etc/passwd'"),
    Case("key_empty", edit_array(0, key=""), errors.ManifestError,
         ARRAY0_RE + ": invalid array key ''"),
    Case("two_arrays_one_key",
         edit(lambda m: m["arrays"][1].update(key=m["arrays"][0]["key"])),
         errors.ManifestError,
         MANIFEST_RE + r": arrays\[0\] and arrays\[1\] share the storage key '00000_"),
    # Labels.
    Case("label_with_nul", edit(control_char_label), errors.ManifestError,
         MANIFEST_RE + r": arrays\[0\] \(label 'mlp/\\x00evil'\): invalid label"),
    Case("label_dotdot_in_arrays_table", edit_array(0, label="../../../etc/passwd"),
         errors.ManifestError,
         rf"penzai: variables\[0\] \(label '{LABEL0_RE}'\)\S* arrays\[0\] is labelled"
         r" '\.\./\.\./\.\./etc/passwd' in the arrays"
         rf" table, but is held by variable '{LABEL0_RE}'", DECODING),
    Case("label_absolute_in_arrays_table", edit_array(0, label="/etc/passwd"),
         errors.ManifestError,
         rf"arrays\[0\] is labelled '/etc/passwd'.*held by variable '{LABEL0_RE}'",
         DECODING),
    Case("duplicate_variable_labels", edit(duplicate_variable_labels),
         errors.ManifestError,
         rf"variables\[2\] has label '{LABEL0_RE}', like variables\[0\]",
         frozenset({LOAD_MODEL, INTO})),
    # Shapes, sizes and axes.
    Case("shape_disagrees_with_stored_array", set_shape(0, [16, 8]), errors.ManifestError,
         rf"penzai: label '{LABEL0_RE}' at tree\S* \(key 00000_\w+\) should be"
         r" float32\[16, 8\] by the manifest, but the stored array is float32\[8, 16\]",
         frozenset({LOAD, LOAD_MODEL})),
    Case("huge_shape_beyond_addressable", set_shape(0, [2**40, 2**40]),
         errors.UnsafeCheckpointError,
         ARRAY0_RE + r": shape \[1099511627776, 1099511627776\] declares \d+ elements"),
    Case("huge_shape_over_memory", set_shape(0, [2**30, 2**30]),  # 2**62 bytes: representable.
         errors.UnsafeCheckpointError,
         rf"penzai: reading these arrays would allocate \d+ bytes.*label '{LABEL0_RE}'",
         frozenset({LOAD, LOAD_MODEL})),
    Case("huge_shape_in_orbax_metadata", set_zarray_shape([2**31, 2**31]),
         errors.ManifestError,
         rf"label '{LABEL0_RE}'.* should be float32\[8, 16\] by the manifest, but the"
         r" stored array is float32\[2147483648, 2147483648\]", READING),
    Case("huge_chunks_in_orbax_metadata", set_zarray_shape([2**20, 2**20], "chunks"),
         errors.UnsafeCheckpointError,
         rf"label '{LABEL0_RE}'.* is stored in chunks of \[1048576, 1048576\], which do not"
         r" fit its shape \[8, 16\]", READING),
    Case("huge_shape_in_manifest_and_orbax_metadata",
         both(set_shape(0, [2**30, 2**30]), set_zarray_shape([2**30, 2**30])),
         errors.UnsafeCheckpointError, r"would allocate \d+ bytes",
         frozenset({LOAD, LOAD_MODEL})),
    Case("allocation_over_limit", allocation_over_limit, errors.UnsafeCheckpointError,
         r"penzai: reading these arrays would allocate \d+ bytes, more than the"
         rf" 64-byte limit.*label '{LABEL0_RE}'", READING),
    Case("axes_more_names_than_dims",
         edit(lambda m: _variable0_axes(m).append([{"t": "str", "v": "extra"}, 3])),
         errors.ManifestError,
         rf"variables\[0\] \(label '{LABEL0_RE}'\)\.value: axis names disagree"),
    Case("axes_fewer_names_than_dims", edit(lambda m: _variable0_axes(m).pop()),
         errors.ManifestError,
         rf"variables\[0\] \(label '{LABEL0_RE}'\)\.value: axis names disagree"),
    Case("axis_size_is_a_float",
         edit(lambda m: _variable0_axes(m)[0].__setitem__(1, 8.0)), errors.ManifestError,
         rf"variables\[0\] \(label '{LABEL0_RE}'\)\.value: axis 'features' repeats or"
         r" has an invalid size 8\.0"),
    Case("axis_size_is_nan_string",
         edit(lambda m: _variable0_axes(m)[0].__setitem__(1, "NaN")), errors.ManifestError,
         r"variables\[0\].*invalid size 'NaN'"),
    # References and nesting in the tree.
    Case("array_ref_is_a_float",
         edit(lambda m: m["variables"][0]["value"]["data"].update(ref=0.0)),
         errors.ManifestError,
         r"penzai: variables\[0\].*invalid array reference 0\.0", DECODING),
    Case("array_ref_is_a_bool",
         edit(lambda m: m["variables"][0]["value"]["data"].update(ref=True)),
         errors.ManifestError, r"variables\[0\].*invalid array reference True", DECODING),
    Case("array_ref_out_of_range",
         edit(lambda m: m["variables"][0]["value"]["data"].update(ref=10**6)),
         errors.ManifestError, r"variables\[0\].*invalid array reference 1000000",
         DECODING),
    Case("variable_ref_out_of_range",
         edit(lambda m: m["tree"]["fields"][0][1]["items"][0]["fields"][0][1]["items"][0]
              ["fields"][0][1].update(ref=-1)),
         errors.ManifestError,
         r"penzai: tree\.sublayers\[0\]\.sublayers\[0\]\.weights: invalid variable"
         r" reference -1", DECODING),
    Case("variable_kind_is_an_int", edit(lambda m: m["variables"][0].update(kind=1)),
         errors.ManifestError, r"penzai: variables\[0\].*(malformed|unknown variable kind)"),
    Case("deep_nesting_within_json_limits",
         edit(lambda m: _elementwise(m)["fields"][0].__setitem__(1, nested_lists(200))),
         errors.ManifestError,
         r"penzai: tree(\.sublayers\[1\]\.fn(\[0\])+)?: nesting (deeper than \d+|too deep)", DECODING),
    # Device meshes: axis names and sizes, rebuilt over the devices at hand.
    Case("mesh_of_a_quadrillion_devices",
         edit(lambda m: _elementwise(m)["fields"][0].__setitem__(1, {
             "t": "mesh", "axes": [["data", 10**15]], "axis_types": ["Explicit"]})),
         errors.MeshError,
         FN_RE + r": the saved mesh \(data=1000000000000000\) needs 1000000000000000 devices",
         frozenset({LOAD, LOAD_MODEL})),
    Case("mesh_size_zero",
         edit(lambda m: _elementwise(m)["fields"][0].__setitem__(1, {
             "t": "mesh", "axes": [["data", 0]], "axis_types": ["Explicit"]})),
         errors.ManifestError, FN_RE + r": malformed mesh", DECODING),
    Case("mesh_axis_name_is_a_node",
         edit(lambda m: _elementwise(m)["fields"][0].__setitem__(1, {
             "t": "mesh", "axes": [[{"t": "str", "v": "x"}, 2]], "axis_types": ["Explicit"]})),
         errors.ManifestError, FN_RE + r": malformed mesh", DECODING),
    Case("named_sharding_over_a_non_mesh",
         edit(lambda m: _elementwise(m)["fields"][0].__setitem__(1, {
             "t": "named_sharding", "mesh": {"t": "int", "v": 3},
             "spec": {"t": "partition_spec", "spec": [None]}, "memory_kind": None})),
         errors.ManifestError, FN_RE + r": malformed NamedSharding", DECODING),
    Case("partition_spec_holds_a_number",
         edit(lambda m: _elementwise(m)["fields"][0].__setitem__(1, {
             "t": "partition_spec", "spec": [3]})),
         errors.ManifestError, FN_RE + r": malformed PartitionSpec", DECODING),
    # Code named by the structure.
    Case("function_os_system", set_fn("os", "system"), errors.DisallowedModuleError,
         FN_RE + r": the checkpoint names the function os\.system", DECODING),
    Case("function_builtins_eval", set_fn("builtins", "eval"), errors.DisallowedModuleError,
         FN_RE + r": the checkpoint names the function builtins\.eval", DECODING),
    Case("function_builtins_import", set_fn("builtins", "__import__"),
         errors.ManifestError, FN_RE + r": refusing private name builtins\.__import__", DECODING),
    Case("function_importlib_import_module", set_fn("importlib", "import_module"),
         errors.DisallowedModuleError, FN_RE + r": .*importlib\.import_module", DECODING),
    Case("function_numpy_load", set_fn("numpy", "load"), errors.DisallowedModuleError,
         FN_RE + r": numpy\.load may not be named", DECODING),
    Case("function_jax_numpy_save", set_fn("jax.numpy", "save"),
         errors.DisallowedModuleError, FN_RE + r": .*jax\.numpy\.save", DECODING),
    Case("function_through_imported_module", set_fn("penzai.core.struct", "inspect.getsource"),
         errors.DisallowedModuleError,  # Functions of allowed modules are module-level.
         FN_RE + r": the checkpoint names the function penzai\.core\.struct\.inspect"
         r"\.getsource, which is not allowed", DECODING),
    Case("function_unimported_module", set_fn("antigravity", "geohash"),
         errors.DisallowedModuleError,
         FN_RE + r": .*antigravity\.geohash.*not imported", DECODING,
         unimported="antigravity"),
    Case("class_subprocess_popen", set_class(0, "subprocess", "Popen"),
         errors.DisallowedModuleError,
         r"tree\.sublayers\[0\]: the checkpoint names subprocess\.Popen", DECODING),
    Case("class_unimported_module", set_class(0, "this", "Zen"), errors.DisallowedModuleError,
         r"tree\.sublayers\[0\]: the checkpoint names this\.Zen; module 'this' is not"
         r" allow-listed, so it was not imported", DECODING, unimported="this"),
    Case("class_not_a_layer", set_class(0, "jax.numpy", "ndarray"), errors.ManifestError,
         r"tree\.sublayers\[0\]: jax\.numpy\.ndarray is not a pz\.Struct class", DECODING),
    # Orbax's files.
    Case("orbax_metadata_garbage", orbax_metadata_garbage, errors.IntegrityError,
         r"penzai: Orbax's metadata of the stored arrays \(_METADATA", READING),
    Case("orbax_metadata_missing", orbax_metadata_missing, errors.IntegrityError,
         r"penzai: Orbax's metadata of the stored arrays \(_METADATA", READING),
    Case("checkpoint_metadata_garbage", checkpoint_metadata_garbage, errors.ManifestError,
         r"ckpt/_CHECKPOINT_METADATA: Orbax's checkpoint metadata is not a JSON object"),
    # Array data files.
    Case("data_files_truncated", damage_data(lambda b: b[: len(b) // 2]), DAMAGED,
         r"penzai: .*(cannot be read|damaged)", READING),
    Case("data_files_empty", damage_data(lambda b: b""), DAMAGED,
         r"penzai: .*(cannot be read|damaged)", READING),
    Case("data_files_flipped_bytes", damage_data(flip_middle), DAMAGED,
         r"penzai: .*(cannot be read|damaged|do not match)", READING),
    Case("data_files_missing", data_files_missing, DAMAGED,
         r"penzai: .*(cannot be read|damaged)", READING),
    Case("ocdbt_manifest_missing", ocdbt_manifest_missing, DAMAGED,
         r"penzai: .*(cannot be read|damaged)", READING),
    # Small arrays are read as raw OCDBT entries (storage.reading.raw_chunks): a
    # .zarray in TensorStore's own form that lies, and chunks of the wrong
    # length, are left to TensorStore's array driver, which refuses them.
    Case("raw_zarray_says_int32", lie_in_zarray(dtype="<i4"), errors.ManifestError,
         rf"label '{LABEL0_RE}'.* should be float32\[8, 16\] by the manifest, but the"
         r" stored array is int32\[8, 16\]", READING),
    Case("raw_zarray_says_float64", lie_in_zarray(dtype="<f8"), errors.ManifestError,
         rf"label '{LABEL0_RE}'.* should be float32\[8, 16\] by the manifest, but the"
         r" stored array is float64\[8, 16\]", READING),
    Case("raw_zarray_other_shape", lie_in_zarray(shape=[16, 8], chunks=[16, 8]),
         errors.ManifestError,
         rf"label '{LABEL0_RE}'.* should be float32\[8, 16\] by the manifest, but the"
         r" stored array is float32\[16, 8\]", READING),
    Case("raw_zarray_fortran_order", lie_in_zarray(order="F"), errors.IntegrityError,
         rf"label '{LABEL0_RE}'.*differ", READING),
    Case("raw_zarray_big_endian", lie_in_zarray(dtype=">f4"), errors.IntegrityError,
         rf"label '{LABEL0_RE}'.*differ", READING),
    Case("raw_zarray_compressed", lie_in_zarray(compressor={"id": "zstd", "level": 1}),
         errors.IntegrityError, rf"cannot read the stored array\(s\) of label '{LABEL0_RE}'",
         READING),
    Case("raw_zarray_other_separator", lie_in_zarray(dimension_separator="/"),
         errors.IntegrityError, rf"cannot read the stored array\(s\) of label '{LABEL0_RE}'",
         READING),
    Case("raw_chunk_short", change_chunk(lambda b: b[:-4]), errors.IntegrityError,
         rf"cannot read the stored array\(s\) of label '{LABEL0_RE}'", READING),
    Case("raw_chunk_long", change_chunk(lambda b: b + bytes(4)), errors.IntegrityError,
         rf"cannot read the stored array\(s\) of label '{LABEL0_RE}'", READING),
    Case("raw_chunk_empty", change_chunk(lambda b: b""), errors.IntegrityError,
         rf"cannot read the stored array\(s\) of label '{LABEL0_RE}'", READING),
    Case("raw_chunk_missing", change_chunk(lambda b: None), errors.IntegrityError,
         rf"cannot read the stored array\(s\) of label '{LABEL0_RE}'", READING),
    Case("raw_chunk_flipped", change_chunk(flip_middle), errors.IntegrityError,
         rf"label '{LABEL0_RE}'.*differ", READING),
    # Files that are not what they seem.
    Case("data_dir_symlink_outside", data_dir_symlink_outside, errors.UnsafeCheckpointError,
         r"penzai/d is a symlink to .*outside/d, outside the checkpoint"),
    Case("data_file_symlink_to_etc_passwd", data_file_symlink_to_etc,
         errors.UnsafeCheckpointError,
         r"penzai/d/\w+ is a symlink to /etc/passwd, outside the checkpoint"),
    Case("data_file_fifo", data_file_fifo, errors.UnsafeCheckpointError,
         r"penzai/d/\w+ is a FIFO, not a regular file"),
    Case("item_dir_symlink_outside", item_symlink_outside, errors.UnsafeCheckpointError,
         r"ckpt/penzai is a symlink to .*outside/penzai, outside the checkpoint"),
    # Code named by the structure: modules of allowed trees that must not be
    # imported, and classes held as values (tests/hostile/test_code_references.py).
    Case("class_numpy_test_module", set_class(0, "numpy.linalg.tests.test_linalg", "TestSolve"),
         errors.DisallowedModuleError,
         r"tree\.sublayers\[0\]: .*part 'tests' of module 'numpy\.linalg\.tests", DECODING,
         unimported="numpy.linalg.tests"),
    Case("class_unimported_allowed_module", set_class(0, "jax.experimental.ode", "odeint"),
         errors.DisallowedModuleError,
         r"tree\.sublayers\[0\]: .*'jax\.experimental\.ode' is not imported", DECODING,
         unimported="jax.experimental.ode"),
    Case("type_value_numpy_memmap",
         edit(lambda m: _elementwise(m)["fields"][0].__setitem__(1, {
             "t": "partial", "args": [], "keywords": [],
             "func": {"t": "type", "class": {"module": "numpy", "qualname": "memmap"}}})),
         errors.DisallowedModuleError,
         FN_RE + r"\.func: the class numpy\.memmap is held as a value", DECODING),
    # Names that reach past the allow-list (issue 26): private attributes
    # reached through a class, and what an allowed module merely imported.
    Case("private_setattr_rewrites_jax_nn_relu",
         set_fn_node(_partial(SETATTR, _fn("jax.nn", "relu"), {"t": "str", "v": "fun"})),
         errors.ManifestError,
         FN_RE + r"\.func: refusing private name jax\.scipy\.stats\.gaussian_kde\._setattr"
         r" \(part '_setattr'\)", DECODING),
    Case("private_setattr_rewrites_an_enum_value",
         set_fn_node(_partial(SETATTR, SHARED, {"t": "str", "v": "_value_"})),
         errors.ManifestError, FN_RE + r"\.func: refusing private name .*'_setattr'", DECODING),
    Case("private_class_attribute", set_class(0, "penzai.nn", "Linear._private"),
         errors.ManifestError, r"tree\.sublayers\[0\]: refusing private name"
         r" penzai\.nn\.Linear\._private \(part '_private'\)", DECODING),
    Case("dunder_class_path", set_class(0, "penzai.nn", "Linear.__class__"),
         errors.ManifestError, r"tree\.sublayers\[0\]: .*\(part '__class__'\)", DECODING),
    Case("dunder_globals_path", set_fn("jax.nn", "relu.__globals__"),
         errors.ManifestError, FN_RE + r": .*\(part '__globals__'\)", DECODING),
    Case("method_through_a_class", set_fn("jax.scipy.stats", "gaussian_kde.evaluate"),
         errors.DisallowedModuleError,
         FN_RE + r": the checkpoint names the function jax\.scipy\.stats\.gaussian_kde"
         r"\.evaluate, which is not allowed", DECODING),
    Case("classmethod_through_a_class", set_fn("penzai.nn", "Linear.from_config"),
         errors.DisallowedModuleError, FN_RE + r": .*penzai\.nn\.Linear\.from_config",
         DECODING),
    Case("numpy_memmap_reexported_by_an_allowed_module",
         with_user_module(set_fn_node(_partial(
             {"t": "type", "class": {"module": USER_MODULE, "qualname": "memmap"}},
             {"t": "str", "v": "/tmp/pz_persist_hostile_memmap"}))),
         errors.DisallowedModuleError,
         FN_RE + r"\.func: the class numpy\.memmap is held as a value.*The checkpoint"
         rf" names it {USER_MODULE}\.memmap", DECODING),
    Case("numpy_save_reexported_by_an_allowed_module",
         with_user_module(set_fn(USER_MODULE, "save")), errors.DisallowedModuleError,
         FN_RE + r": the function numpy\.save may not be named.*The checkpoint names it"
         rf" {USER_MODULE}\.save", DECODING),
    Case("numpy_save_through_an_allowed_class",
         with_user_module(set_fn(USER_MODULE, "Holder.writer")), errors.DisallowedModuleError,
         FN_RE + r": the function numpy\.save may not be named", DECODING),
    Case("numpy_save_as_a_staticmethod_of_an_allowed_class",
         with_user_module(set_fn(USER_MODULE, "Holder.dump")), errors.ManifestError,
         FN_RE + r": numpy\.save does not name <staticmethod.*The checkpoint names it"
         rf" {USER_MODULE}\.Holder\.dump", DECODING),
    Case("os_system_reexported_by_an_allowed_module",
         with_user_module(set_fn(USER_MODULE, "system")), errors.DisallowedModuleError,
         FN_RE + rf": {USER_MODULE}\.system is defined in module 'posix'", DECODING),
    Case("os_through_an_allowed_module",
         with_user_module(set_fn(USER_MODULE, "os.system")), errors.ManifestError,
         FN_RE + rf": {USER_MODULE}\.os\.system passes through module 'os'", DECODING),
    Case("partial_of_an_allowed_function_with_a_lent_class",
         with_user_module(set_fn_node(_partial(
             _fn("jax.nn", "relu"),
             {"t": "type", "class": {"module": USER_MODULE, "qualname": "memmap"}}))),
         errors.DisallowedModuleError,
         FN_RE + r"\.args: the class numpy\.memmap is held as a value", DECODING),
    # JSON bombs: refused before parsing (see test_parsing.py for memory).
    # Format 4 (`pz_persist.format.compact`): its tables, columns and references.
    # The MLP's manifest: types[0] struct, [1] list, [2] variable, [3] tuple,
    # [4] function, [5] dict, [6] named_array, [7] array (strings are bare);
    # shared[3] the empty tuple, [4] the empty metadata dict, [5] the axis
    # name "features".
    Case("f4_type_index_out_of_range", edit4(_set(("tree", 0), 99)), errors.ManifestError,
         MANIFEST_RE + r": tree has type 99, not an index of types"),
    Case("f4_type_index_negative", edit4(_set(("tree", 0), -1)), errors.ManifestError,
         MANIFEST_RE + r": tree has type -1, not an index of types"),
    Case("f4_type_unknown", edit4(_set(("types", 5), "pickle")), errors.ManifestError,
         MANIFEST_RE + r": types\[5\]: unknown node type 'pickle'"),
    Case("f4_type_repeated", edit4(_set(("types", 5), "struct")), errors.ManifestError,
         MANIFEST_RE + r": types repeats a node type"),
    Case("f4_shared_index_out_of_range", edit4(_set(("variables", 0, 2), 99)),
         errors.ManifestError,
         MANIFEST_RE + r": variables\[0\]\.metadata refers to shared\[99\], which does not exist"),
    Case("f4_shared_index_negative", edit4(_set(("variables", 0, 2), -1)),
         errors.ManifestError,
         MANIFEST_RE + r": variables\[0\]\.metadata refers to shared\[-1\]"),
    Case("f4_class_index_out_of_range", edit4(_set(("tree", 1), 50)), errors.ManifestError,
         MANIFEST_RE + r": tree\.class is 50, not an index of classes"),
    Case("f4_class_not_allowed", edit4(_set(("classes", 0), ["subprocess", "Popen"])),
         errors.DisallowedModuleError, r"the checkpoint names subprocess\.Popen", DECODING),
    Case("f4_class_unimported_module", edit4(_set(("classes", 5), ["antigravity", "Fly"])),
         errors.DisallowedModuleError, r"antigravity\.Fly.*not imported", DECODING,
         unimported="antigravity"),
    Case("f4_class_not_two_strings", edit4(_set(("classes", 0), ["penzai", 3])),
         errors.ManifestError, MANIFEST_RE + r": classes\[0\] is \['penzai', 3\]"),
    Case("f4_table_entry_unused",
         edit4(lambda m: m["classes"].append(["penzai.nn.grouping", "Sequential"])),
         errors.ManifestError, MANIFEST_RE + r": classes\[6\] is used by no node"),
    Case("f4_shared_bad_dtype",
         edit4(lambda m: (m["types"].append("dtype"),
                          m["shared"].__setitem__(5, [len(m["types"]) - 1, "object"]))),
         errors.ManifestError, r"unknown dtype 'object'", DECODING),
    Case("f4_shared_bad_axis_name", edit4(_set(("shared", 5), [1, []])),
         errors.ManifestError, r"axis name \[\] is unhashable", DECODING),
    Case("f4_shared_holds_an_array", edit4(_set(("shared", 5), [7, 0])),
         errors.ManifestError,
         MANIFEST_RE + r": shared\[5\] is a array node: a shared entry holds static values only"),
    Case("f4_shared_refers_to_shared", edit4(_set(("shared", 0), [3, [5]])),
         errors.ManifestError,
         MANIFEST_RE + r": shared\[0\]\[0\] refers to a shared entry from a shared entry"),
    Case("f4_tree_is_a_reference", edit4(_set(("tree",), 2)), errors.ManifestError,
         MANIFEST_RE + r": tree must be a node"),
    Case("f4_node_with_a_field_too_many", edit4(lambda m: m["tree"].append(1)),
         errors.ManifestError,
         MANIFEST_RE + r": tree is a struct node with 3 fields, expected 2 \(class, fields\)"),
    Case("f4_node_not_a_list", edit4(_set(("variables", 0, 1), {"t": "str", "v": "x"})),
         errors.ManifestError, MANIFEST_RE + r": variables\[0\]\.label is \{"),
    Case("f4_depth_bomb", edit4(_set(("variables", 0, 2), _nested(150))),
         errors.ManifestError, MANIFEST_RE + r": variables\[0\]\.metadata.* nests deeper than 100"),
    Case("f4_variable_contains_itself", edit4(_set(("variables", 0, 3), [2, 0])),
         errors.ManifestError, r"variable 0 contains itself", DECODING),
    Case("f4_variable_not_four_fields", edit4(lambda m: m["variables"][0].pop()),
         errors.ManifestError,
         MANIFEST_RE + r": variables\[0\] must be \[kind, label, metadata, value\]"),
    Case("f4_array_reference_out_of_range", edit4(_set(("variables", 0, 3, 2, 1), 99)),
         errors.ManifestError, r"invalid array reference 99", DECODING),
    Case("f4_columns_disagree", edit4(lambda m: m["arrays"]["key"].pop()),
         errors.ManifestError, MANIFEST_RE + r": arrays\.key must be a list of 4 entries"),
    Case("f4_count_far_beyond_the_data", edit4(_set(("arrays", "count"), 10**15)),
         errors.ManifestError,
         MANIFEST_RE + r": arrays\.key must be a list of 1000000000000000 entries"),
    Case("f4_count_negative", edit4(_set(("arrays", "count"), -4)), errors.ManifestError,
         MANIFEST_RE + r": arrays\.count is -4, not a count"),
    Case("f4_array_column_missing", edit4(lambda m: m["arrays"].pop("checksums")),
         errors.ManifestError, MANIFEST_RE + r": arrays must be an object of the columns"),
    Case("f4_duplicate_array_keys",
         edit4(lambda m: m["arrays"]["key"].__setitem__(1, m["arrays"]["key"][0])),
         errors.ManifestError, MANIFEST_RE + r": arrays 0 and 1 share the storage key"),
    Case("f4_array_key_is_a_path", edit4(_set(("arrays", "key", 2), "../../etc")),
         errors.ManifestError, MANIFEST_RE + r": arrays\.key\[2\] is an invalid array key"),
    Case("f4_leaf_key_without_leaf_keys", edit4(_set(("arrays", "key", 2), "a.b")),
         errors.ManifestError, MANIFEST_RE + r": arrays\.key\[2\] is an invalid array key 'a\.b'"),
    Case("f4_shape_index_out_of_range", edit4(_set(("arrays", "shape", 3), 9)),
         errors.ManifestError,
         MANIFEST_RE + r": arrays\.shape\[3\] is 9, not an index of its table of 4 entries"),
    Case("f4_shape_table_negative_size", edit4(_set(("arrays", "shapes", 1), [-16])),
         errors.ManifestError, MANIFEST_RE + r": arrays\.shapes\[1\] is an invalid shape"),
    Case("f4_dtype_table_bad_dtype", edit4(_set(("arrays", "dtypes", 0), "object")),
         errors.ManifestError, MANIFEST_RE + r": arrays\.dtypes\[0\]: unknown dtype 'object'"),
    Case("f4_kind_table_bad_kind", edit4(_set(("arrays", "kinds", 0), "pickle")),
         errors.ManifestError, MANIFEST_RE + r": arrays\.kinds\[0\] is an unknown array kind"),
    Case("f4_label_with_control_characters",
         edit4(_set(("arrays", "label", 1), "mlp\x1b[2J")),
         errors.ManifestError, MANIFEST_RE + r": arrays\.label\[1\] is an invalid label"),
    Case("f4_weak_type_out_of_range", edit4(_set(("arrays", "weak_type"), [7])),
         errors.ManifestError, MANIFEST_RE + r": arrays\.weak_type must list"),
    Case("f4_checksum_missing", edit4(_set(("arrays", "checksums", 0), None)),
         errors.ManifestError, MANIFEST_RE + r": arrays\.checksums\[0\] is missing"),
    Case("f4_checksum_not_a_digest", edit4(_set(("arrays", "checksums", 2), "zz" * 16)),
         errors.ManifestError, MANIFEST_RE + r": arrays\.checksums\[2\] is not an xxh3_128 digest"),
    Case("f4_checksum_slices_overlap",
         edit4(_set(("arrays", "checksums", 1), [[[[0, 16]], "0" * 32], [[[0, 16]], "1" * 32]])),
         errors.ManifestError, MANIFEST_RE + r": arrays\.checksums\[1\]: the checksums' slices"),
    Case("f4_leaf_keys_not_a_boolean", edit4(_set(("leaf_keys",), "yes")),
         errors.ManifestError, MANIFEST_RE + r": leaf_keys must be true or false"),
    Case("f4_extra_field", edit4(_set(("pickle",), "gASV")), errors.ManifestError,
         MANIFEST_RE + r": manifest fields .*'pickle'.*\(format 4\)"),
    Case("f4_claims_format_5", edit4(_set(("format_version",), 5)), errors.FormatVersionError,
         MANIFEST_RE + r".*manifest format 5: it needs a pz_persist that reads format 5;.* reads"
         r" formats 1 to 4"),
    Case("f4_truncated", raw(lambda b: b[: b.index(b'"arrays"')]), errors.ManifestError,
         MANIFEST_RE + ": not valid JSON"),
    Case("manifest_node_bomb", raw(lambda b: b[:-1] + b', "x": [' + b"{}," * 300_000 + b"{}]}"),
         errors.ManifestError, MANIFEST_RE + r": \d+ JSON values in \d+ bytes, over the limit"),
    Case("orbax_metadata_node_bomb",
         write_file("penzai/_METADATA", b"[" + b"[]," * 300_000 + b"[]]"),
         errors.ManifestError, r"penzai/_METADATA: \d+ JSON values", READING),
    Case("checkpoint_metadata_deep", write_file("_CHECKPOINT_METADATA", b"[" * 10**5),
         errors.ManifestError, r"ckpt/_CHECKPOINT_METADATA: Orbax's checkpoint metadata is not"),
    # Downgrades: a format that records checksums must have them, whole.
    Case("checksums_deleted", edit(lambda m: [a.pop("checksums") for a in m["arrays"]]),
         errors.ManifestError,
         MANIFEST_RE + rf": arrays\[0\] \(label '{LABEL0_RE}' at tree\S*\) has no checksums"),
    Case("downgraded_to_format_1",
         edit(lambda m: ([a.pop("checksums") for a in m["arrays"]], m.update(format_version=1))),
         errors.ManifestError,
         MANIFEST_RE + r": format 1 \(no checksums\) beside pz_persist\.files\.json"),
    Case("checksum_slices_repeated",
         edit(lambda m: m["arrays"][0].update(checksums=m["arrays"][0]["checksums"] * 3)),
         errors.ManifestError,
         MANIFEST_RE + rf": arrays\[0\] \(label '{LABEL0_RE}'\): the checksums' slices"
         r" do not cut the array of shape \[8, 16\] into a grid"),
    # Escape sequences where the manifest holds free text that is printed.
    Case("writer_with_escapes", edit(lambda m: m.update(writer="pz\x1b]0;x\x07\x1b[2J")),
         errors.ManifestError, MANIFEST_RE + r": invalid writer 'pz\\x1b\]0;x"),
    Case("path_with_escapes", edit(lambda m: m["arrays"][1].update(path="tree\r\x1b[1A")),
         errors.ManifestError, MANIFEST_RE + r": arrays\[1\].*: invalid path 'tree\\r"),
    # A NamedArray that does not fit its data (as in optax's states).
    Case("variable_named_array_does_not_fit_its_data",
         edit(variable0_axes_beside_its_data), errors.PzPersistError,
         rf"{LABEL0_RE}.*structure", frozenset({INTO})),
]
