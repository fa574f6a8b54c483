"""Former class names are a recorded table, never a way in (issue 38, item 2).

A checkpoint written before pz_persist's layers moved names them
``pz_persist.pretrained.layers.<module>.<Class>``; loading reads exactly the
names recorded in `pz_persist.format.former_names` as their current names,
before the allow-list and the lookup judge them. Attacks on that surface, as
forged manifests:

* a former-looking name the table does not hold (another class of the old
  module, a function, extra qualname parts, the package itself, a module
  that never existed) is refused exactly as it is with no table at all;
* ``allow_modules`` of the former tree lends such names nothing, and a
  module a user plants at a former path is not what the recorded name finds;
* a table entry pointing outside the allowed modules, or at a private name,
  is refused by the checks that judge the current name; a table looping
  back on itself ends in a refusal, never in a loop;
* a checkpoint cannot add an alias: a reference holds exactly ``module`` and
  ``qualname``, and the table is read-only code.

Each forged checkpoint is read by every library entry point that decodes a
model (`load_model`, `load`, `open().load()`; and `inspect`, Orbax v0 and
v1, both managers, `load_into` and ``diff``, library and CLI, in
`test_every_entry_point_reads_former_names_through_the_table_only`).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
import shutil
import sys
import types

import hypothesis
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from hypothesis import strategies as st
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from hostile import catalogue
from pz_persist import errors
from pz_persist.format import former_names
from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.nn.offset_scale import OffsetScale
from pz_persist.tools import cli

OLD = "pz_persist.pretrained.layers"
LOADERS = {
    "load_model": pzp.load_model,
    "load": pzp.load,
    "open": lambda path, **kw: pzp.open(path, **kw).load(),
}


@pytest.fixture(name="saved")
def _saved(tmp_path):
  """A checkpoint of two pz_persist.nn layers, written with their current names."""
  model = pz.nn.Sequential([
      ConstantScale(by=0.5, divide=True),
      OffsetScale(weights=pz.Parameter(value=pz.nx.wrap(jnp.arange(3.0), "embedding"),
                                       label="offset")),
  ])
  path = tmp_path / "ckpt"
  pzp.save_model(path, model)
  return path


def _name(ckpt, index: int, module: str, qualname: str) -> None:
  catalogue.set_class(index, module, qualname)(ckpt, None)


def _refusal(loader, path, **kwargs) -> tuple[type, str]:
  with pytest.raises(errors.PzPersistError) as raised:
    loader(path, **kwargs)
  return type(raised.value), str(raised.value)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_recorded_former_name_loads_as_the_current_class(saved, loader):
  _name(saved, 0, f"{OLD}.constant_scale", "ConstantScale")  # Former...
  loaded = LOADERS[loader](saved)  # ...beside a current name in one manifest.
  assert type(loaded.sublayers[0]) is ConstantScale and loaded.sublayers[0].by == 0.5
  assert type(loaded.sublayers[1]) is OffsetScale


UNRECORDED = [
    (f"{OLD}.constant_scale", "NoSuchLayer"),  # Another name of a moved module.
    (f"{OLD}.scaled_rope", "ConstantScale"),  # A moved class under another module.
    (f"{OLD}.constant_scale", "ConstantScale.by"),  # Extra qualname parts.
    (f"{OLD}.constant_scale", "ConstantScale.ConstantScale"),
    (f"{OLD}.constant_scale.ConstantScale", "ConstantScale"),
    (OLD, "ConstantScale"),  # The package, without the module.
    (f"{OLD}.offset_scale_v2", "OffsetScale"),  # A module that never existed.
    ("pz_persist.pretrained.layer.constant_scale", "ConstantScale"),
    ("pz_persist.pretrained", "ConstantScale"),
    ("pz_persist.nn.no_such_module", "ConstantScale"),
    ("pz_persist.nn.constant_scale", "NoSuchLayer"),
]


def _without_table(monkeypatch, loader, path, **kwargs) -> tuple[type, str]:
  with monkeypatch.context() as patch:
    patch.setattr(former_names, "FORMER_NAMES", types.MappingProxyType({}))
    return _refusal(loader, path, **kwargs)


@pytest.mark.parametrize("name", UNRECORDED, ids=".".join)
@pytest.mark.parametrize("allow", [None, [OLD], ["pz_persist"]], ids=["default", "old", "pkg"])
def test_an_unrecorded_name_is_refused_as_without_a_table(saved, monkeypatch, name, allow):
  """The table changes nothing for a name it does not hold: same class of
  error, same message, whatever the user allowed."""
  _name(saved, 0, *name)
  for loader in LOADERS.values():
    got = _refusal(loader, saved, allow_modules=allow)
    assert got == _without_table(monkeypatch, loader, saved, allow_modules=allow), name
    assert f"{name[0]}.{name[1]}" in got[1] or name[0] in got[1], got
  if allow is None and name[0].startswith(OLD):
    assert got[0] is errors.DisallowedModuleError and "not allow-listed" in got[1], got


@pytest.mark.parametrize("name", [
    (f"{OLD}.mixture_of_experts", "experts_mlp"),  # A function of a moved module.
    (f"{OLD}.scaled_rope", "check_computable"),
    (f"{OLD}.constant_scale", "ConstantScale"),  # A recorded class named as a function.
], ids=".".join)
def test_a_former_name_held_as_a_function_is_refused(saved, monkeypatch, name):
  def forge(m):
    m["tree"]["fields"][0][1]["items"][0]["fields"][0][1] = {
        "t": "function", "ref": {"module": name[0], "qualname": name[1]}}
  catalogue.edit(forge)(saved, None)
  for loader in LOADERS.values():
    kind, message = _refusal(loader, saved)
    assert kind is errors.DisallowedModuleError, message
    if name[1] != "ConstantScale":
      assert (kind, message) == _without_table(monkeypatch, loader, saved)


def test_a_module_planted_at_a_former_path_is_not_what_the_name_finds(saved, monkeypatch):
  """A user module at the former path, even allowed, never replaces the
  recorded class; and saving its class is refused, since loading would
  find another."""
  planted = types.ModuleType(f"{OLD}.constant_scale")

  @pz.pytree_dataclass
  class Impostor(pz.nn.Layer):  # pylint: disable=missing-class-docstring
    by: float = 1.0

    def __call__(self, inputs, **side_inputs):
      return inputs

  Impostor.__module__ = planted.__name__
  Impostor.__qualname__ = Impostor.__name__ = "ConstantScale"
  planted.ConstantScale = Impostor  # type: ignore[attr-defined]
  monkeypatch.setitem(sys.modules, planted.__name__, planted)
  _name(saved, 0, f"{OLD}.constant_scale", "ConstantScale")
  for loader in LOADERS.values():
    assert type(loader(saved, allow_modules=[OLD]).sublayers[0]) is ConstantScale
  with pytest.raises(errors.EncodingError, match="recorded as the former name of"):
    pzp.save_model(saved.parent / "impostor", Impostor(), allow_modules=[OLD])


@pytest.mark.parametrize("target", [
    ("os", "system"), ("numpy", "memmap"), ("numpy.lib.format", "open_memmap"),
    ("pz_persist.nn.mixture_of_experts", "_Rule"), ("pz_persist.nn.constant_scale", "jax"),
    ("pz_persist.errors", "PzPersistError"),
], ids=".".join)
def test_an_alias_cannot_point_outside_what_is_allowed(saved, monkeypatch, target):
  """Were a table entry to point outside the allowed modules (or at a
  private or imported name), the checks judging the current name refuse it."""
  former = (f"{OLD}.constant_scale", "ConstantScale")
  monkeypatch.setattr(former_names, "FORMER_NAMES", types.MappingProxyType({former: target}))
  _name(saved, 0, *former)
  for loader in LOADERS.values():
    kind, message = _refusal(loader, saved)
    assert kind in (errors.DisallowedModuleError, errors.ManifestError), message
    assert target[0] in message, message


def test_a_looping_table_ends_in_a_refusal(saved, monkeypatch):
  former = (f"{OLD}.constant_scale", "ConstantScale")
  current = ("pz_persist.nn.constant_scale", "ConstantScale")
  monkeypatch.setattr(former_names, "FORMER_NAMES",
                      types.MappingProxyType({former: current, current: former}))
  for name in (former, current):
    _name(saved, 0, *name)
    for loader in LOADERS.values():
      kind, message = _refusal(loader, saved)
      assert kind in (errors.DisallowedModuleError, errors.ManifestError), message


@pytest.mark.parametrize("forge", [
    lambda m: m["tree"]["fields"][0][1]["items"][0]["class"].update(
        {"former": {"module": "os", "qualname": "system"}}),
    lambda m: m["tree"]["fields"][0][1]["items"][0].update(
        {"former_names": {f"{OLD}.x.Y": "os.system"}}),
    lambda m: m.update({"former_names": {f"{OLD}.constant_scale.X": "os.system"}}),
], ids=["in-reference", "in-node", "top-level"])
def test_a_checkpoint_cannot_add_an_alias(saved, forge):
  before = copy.deepcopy(dict(former_names.FORMER_NAMES))
  catalogue.edit(forge)(saved, None)
  for loader in LOADERS.values():
    with pytest.raises(errors.ManifestError):
      loader(saved)
  assert dict(former_names.FORMER_NAMES) == before


_FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "releases" / "0.7.0.dev0"


@hypothesis.settings(max_examples=20, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(data=st.data())
def test_any_mix_of_former_and_current_names_loads_the_same(tmp_path_factory, data):
  """Property: whichever of the fixture's classes a manifest names by their
  former or current names, in any mix, the load is the same model, bit for
  bit (the description the fixture's writer recorded)."""
  path = tmp_path_factory.mktemp("mix") / "ckpt"
  shutil.copytree(_FIXTURE / "model", path)
  manifest = path / "penzai" / "pz_persist.json"
  raw = json.loads(manifest.read_text())
  moved = [i for i, (m, q) in enumerate(raw["classes"]) if former_names.is_former(m, q)]
  current = data.draw(st.lists(st.sampled_from(moved), unique=True), label="renamed")
  for i in current:
    raw["classes"][i] = list(former_names.current_name(*raw["classes"][i]))
  manifest.write_text(json.dumps(raw))
  spec = importlib.util.spec_from_file_location(
      "make_release_fixture", _FIXTURE.parent / "make_release_fixture.py")
  assert spec is not None and spec.loader is not None
  generator = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(generator)
  want = json.loads((_FIXTURE / "expected.json").read_text())["model"]
  got = generator.describe(pzp.load_model(path))
  rename = {f"{m}.{q}": ".".join(now) for (m, q), now in former_names.FORMER_NAMES.items()}
  assert got == _renamed(want, rename)


def _renamed(description, rename):
  if isinstance(description, dict):
    return {k: rename.get(v, v) if k == "class" else _renamed(v, rename)
            for k, v in description.items()}
  if isinstance(description, list):
    return [_renamed(item, rename) for item in description]
  return description


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    module=st.from_regex(r"\A(pz_persist\.(pretrained\.layers|nn)|[a-z]{1,6})(\.[a-z_]{1,12}){0,2}\Z"),
    qualname=st.from_regex(r"\A[A-Za-z][A-Za-z0-9]{0,12}(\.[A-Za-z]{1,6})?\Z"),
)
def test_a_name_not_recorded_is_never_translated(module, qualname):
  """Property: only recorded pairs change; every other name is itself."""
  expected = former_names.FORMER_NAMES.get((module, qualname), (module, qualname))
  assert former_names.current_name(module, qualname) == expected
  assert former_names.is_former(module, qualname) == ((module, qualname) in former_names.FORMER_NAMES)


def _more_entry_points(path, run) -> dict:
  """The entry points beyond `LOADERS` that decode a model's classes: the
  library's inspect, Orbax v0 (a checkpointer and a manager) and v1, and
  pz_persist's CheckpointManager, each reading ``path`` or step 1 of ``run``."""
  def orbax_v0_manager():
    with ocp.CheckpointManager(run) as manager:
      return manager.restore(1, args=ocp.args.Composite(penzai=pzp.PenzaiRestore()))["penzai"]

  def manager():
    with pzp.CheckpointManager(run) as opened:
      return opened.restore(1)["penzai"]

  def orbax_v0():
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      return checkpointer.restore(path).penzai

  return {
      "inspect": lambda: pzp.inspect(path),
      "orbax v0": orbax_v0,
      "orbax v0 manager": orbax_v0_manager,
      "orbax v1": lambda: ocp_v1.load_checkpointables(path)["penzai"],
      "CheckpointManager.restore": manager,
  }


@pytest.fixture(name="run")
def _run(tmp_path, saved):
  """Step 1 of a manager run holding the model `saved` holds."""
  path = tmp_path / "run"
  with pzp.CheckpointManager(path) as manager:
    manager.save(1, penzai=pzp.load_model(saved))
  return path


@pytest.mark.parametrize("name", [
    (f"{OLD}.constant_scale", "ConstantScale"),  # Recorded: loads.
    (f"{OLD}.constant_scale", "NoSuchLayer"),  # The rest: refused.
    (f"{OLD}.constant_scale", "ConstantScale.by"),
    (f"{OLD}.scaled_rope", "ConstantScale"),
], ids=".".join)
def test_every_entry_point_reads_former_names_through_the_table_only(saved, run, name):
  """The entry points `LOADERS` misses: a recorded former name loads as the
  current class, any other is refused as `LOADERS` refuse it; `load_into`
  reads no class (the model is given), so it binds whatever the checkpoint
  names; ``diff`` (library and CLI) shows a former name the
  table does not hold as another class (`diff_tree._class_identity`)."""
  _name(saved, 0, *name)
  _name(run / "1", 0, *name)
  recorded = former_names.is_former(*name)
  for entry, read in _more_entry_points(saved, run).items():
    if recorded:
      assert type(read().sublayers[0]) is ConstantScale, entry
    else:
      with pytest.raises(errors.DisallowedModuleError, match="not allow-listed"):
        read()
  model = pz.nn.Sequential([ConstantScale(by=2.0, divide=False), OffsetScale(
      weights=pz.Parameter(value=pz.nx.wrap(jnp.zeros(3), "embedding"), label="offset"))])
  assert type(pzp.load_into(saved, model).sublayers[0]) is ConstantScale
  current = saved.parent / "current"
  pzp.save_model(current, pzp.load_model(saved) if recorded else model)
  text = str(pzp.diff(saved, current))
  if recorded:
    assert "no differences" in text, text
  else:
    assert "replaced" in text and name[1] in text, text
  assert cli.main(["diff", str(saved), str(current)]) == (0 if recorded else 1)
