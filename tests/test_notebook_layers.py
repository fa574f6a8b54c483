"""Layers defined in a notebook (``__main__``) save, and load where defined.

A notebook cell's class lives in ``__main__``. With the user's opt-in
(``allow_modules=["__main__"]``, on save and again on load) a checkpoint may
name it; loading then looks the name up in the running ``__main__`` only,
never imports or runs anything, checks it is a ``pz.Struct`` class with the
saved fields, and when it is not defined says exactly that. The fresh-process
tests are the user's story: save in one interpreter, load in another.
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from conftest import run_python
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.safety import allowlist

_LAYER = """
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz
import pz_persist as pzp

@pz.pytree_dataclass
class MyScale(pz.nn.Layer):
  scale: pz.Parameter
  def __call__(self, x, **unused_side_inputs):
    return x * self.scale.value
"""

_SAVE = _LAYER + """
model = pz.nn.Sequential([
    MyScale(scale=pz.Parameter(value=pz.nx.wrap(jnp.arange(4.0)).tag("d"), label="s")),
    pz.nn.Elementwise(jnp.tanh),
])
pzp.save_model({path!r}, model, allow_modules=["__main__"])
print(model(pz.nx.wrap(jnp.ones(4)).tag("d")).data_array.tolist())
"""

_NOT_DEFINED = (
    "tree.sublayers[0]: __main__.MyScale is not defined in this process: run the cell"
    " that defines it, or move it into a module"
)


def test_saved_in_one_process_loads_in_another_that_defines_it(tmp_path):
  path = str(tmp_path / "m")
  saved = run_python(_SAVE.format(path=path))
  out = run_python(_LAYER + f"""
model = pzp.load_model({path!r}, allow_modules=["__main__"])
assert type(model.sublayers[0]) is MyScale
print(model(pz.nx.wrap(jnp.ones(4)).tag("d")).data_array.tolist())
""")
  assert out == saved  # The same outputs, to the bit (as printed floats).


def test_a_process_that_has_not_defined_it_is_told_exactly_that(tmp_path):
  path = str(tmp_path / "m")
  run_python(_SAVE.format(path=path))
  out = run_python(f"""
import pz_persist as pzp
for load in (pzp.load_model, pzp.load, pzp.inspect):
  try:
    load({path!r}, allow_modules=["__main__"])
  except pzp.errors.NotDefinedError as e:
    print(e)
""")
  lines = out.splitlines()
  assert len(lines) == 3
  for line in lines:
    assert line.startswith(f"{path}/penzai: {_NOT_DEFINED} (")


def test_loading_still_needs_the_opt_in(tmp_path):
  path = str(tmp_path / "m")
  run_python(_SAVE.format(path=path))
  out = run_python(_LAYER + f"""
try:
  pzp.load_model({path!r})
except pzp.errors.DisallowedModuleError as e:
  print(e)
""")
  assert "names __main__.MyScale; module '__main__' is not allow-listed" in out
  assert "allow_modules=['__main__']" in out


# In this interpreter: the class is put into the running ``__main__`` (as a
# notebook cell would), and taken out again by monkeypatch.


def _main_class(name: str, fields: dict[str, type]) -> type:
  namespace = {"__module__": "__main__", "__qualname__": name, "__annotations__": fields}
  namespace["__call__"] = lambda self, x, **unused: x
  return pz.pytree_dataclass(type(name, (pz.nn.Layer,), namespace))


@pytest.fixture
def defined(monkeypatch):
  """Defines a class in ``__main__``, as running a notebook cell does."""

  def define(name: str, value) -> None:
    monkeypatch.setattr(sys.modules["__main__"], name, value, raising=False)

  return define


def _model(cls: type):
  return pz.nn.Sequential([cls(scale=pz.Parameter(value=jnp.arange(3.0), label="s"))])


def test_saving_says_how_to_save_a_notebook_layer(defined, ckpt):
  cls = _main_class("NbScale", {"scale": pz.Parameter})
  defined("NbScale", cls)
  with pytest.raises(errors.DisallowedModuleError) as raised:
    pzp.save_model(ckpt, _model(cls))
  message = str(raised.value)
  assert "__main__.NbScale is defined in module '__main__'" in message
  assert "allow_modules=['__main__']" in message
  assert "run the cell that defines it first, or move it into a module" in message
  assert not ckpt.exists()


def test_a_redefined_class_with_other_fields_is_refused(defined, ckpt):
  cls = _main_class("NbScale", {"scale": pz.Parameter})
  defined("NbScale", cls)
  pzp.save_model(ckpt, _model(cls), allow_modules=["__main__"])
  defined("NbScale", _main_class("NbScale", {"factor": pz.Parameter}))
  with pytest.raises(errors.ManifestError, match=r"NbScale has no field 'scale' \(its fields"
                     r" are now factor\): its code changed since the checkpoint was saved"):
    pzp.load_model(ckpt, allow_modules=["__main__"])


def test_a_name_that_is_not_a_struct_class_is_refused(defined, ckpt):
  cls = _main_class("NbScale", {"scale": pz.Parameter})
  defined("NbScale", cls)
  pzp.save_model(ckpt, _model(cls), allow_modules=["__main__"])
  defined("NbScale", type("NbScale", (), {"__module__": "__main__"}))  # Not a layer.
  with pytest.raises(errors.ManifestError, match=r"__main__\.NbScale is not a pz\.Struct class"):
    pzp.load_model(ckpt, allow_modules=["__main__"])


def test_every_entry_point_finds_it_or_says_it_is_not_defined(defined, tmp_path, monkeypatch):
  """The rule lives where every decoder resolves names: pzp.load, inspect,
  open, the manager and Orbax's handlers all meet the same two outcomes."""
  cls = _main_class("NbScale", {"scale": pz.Parameter})
  defined("NbScale", cls)
  model = _model(cls)
  path = tmp_path / "m"
  pzp.save_model(path, model, allow_modules=["__main__"])
  with pzp.CheckpointManager(tmp_path / "run", allow_modules=["__main__"]) as manager:
    manager.save(1, model=model)
  with allowlist.scoped_allowance(["__main__"]):
    ocp_v1.save_checkpointables(tmp_path / "v1", {"model": model})
  loads = {
      "load_model": lambda: pzp.load_model(path, allow_modules=["__main__"]).sublayers[0],
      "load": lambda: pzp.load(path, allow_modules=["__main__"]).sublayers[0],
      "inspect": lambda: pzp.inspect(path, allow_modules=["__main__"]).sublayers[0],
      "open": lambda: pzp.open(path, allow_modules=["__main__"]).tree.sublayers[0],
      "manager": lambda: _restore(tmp_path / "run")["model"].sublayers[0],
      "orbax v0": lambda: _orbax_v0(path).sublayers[0],
      "orbax v1": lambda: _orbax_v1(tmp_path / "v1")["model"].sublayers[0],
  }
  for name, load in loads.items():
    assert type(load()) is cls, name
  monkeypatch.delattr(sys.modules["__main__"], "NbScale")  # A kernel that has not run the cell.
  for load in loads.values():
    with pytest.raises(errors.NotDefinedError, match=r"__main__\.NbScale is not defined in this"
                       r" process: run the cell that defines it, or move it into a module"):
      load()


def _restore(directory):
  with pzp.CheckpointManager(directory, allow_modules=["__main__"]) as manager:
    return manager.restore(1)


def _orbax_v0(path):
  with allowlist.scoped_allowance(["__main__"]), ocp.Checkpointer(
      ocp.CompositeCheckpointHandler()
  ) as checkpointer:
    return checkpointer.restore(path).penzai


def _orbax_v1(path):
  with allowlist.scoped_allowance(["__main__"]):
    return ocp_v1.load_checkpointables(path)


def test_main_is_never_imported(monkeypatch, defined, ckpt):
  """A ``__main__`` missing from ``sys.modules`` is never imported in its
  place: importing ``__main__`` anew would run a program (``__main__.py``)."""
  import importlib  # pylint: disable=import-outside-toplevel

  cls = _main_class("NbScale", {"scale": pz.Parameter})
  defined("NbScale", cls)
  pzp.save_model(ckpt, _model(cls), allow_modules=["__main__"])
  imported = []
  real = importlib.import_module
  monkeypatch.setattr(importlib, "import_module",
                      lambda name, *a: imported.append(name) or real(name, *a))
  monkeypatch.delitem(sys.modules, "__main__")
  with pytest.raises(errors.NotDefinedError, match=r"__main__\.NbScale is not defined"):
    pzp.load_model(ckpt, allow_modules=["__main__"])
  assert "__main__" not in imported


def test_a_function_defined_in_the_notebook_is_found_or_named(defined, ckpt, monkeypatch):
  """An activation defined in a cell: the same two outcomes as a class."""

  def my_activation(x):
    return x * 2

  my_activation.__module__, my_activation.__qualname__ = "__main__", "my_activation"
  defined("my_activation", my_activation)
  model = pz.nn.Sequential([pz.nn.Elementwise(my_activation)])
  pzp.save_model(ckpt, model, allow_modules=["__main__"])
  assert pzp.load_model(ckpt, allow_modules=["__main__"]).sublayers[0].fn is my_activation
  monkeypatch.delattr(sys.modules["__main__"], "my_activation")  # A new kernel.
  with pytest.raises(errors.NotDefinedError, match=r"tree\.sublayers\[0\]\.fn: __main__\."
                     r"my_activation is not defined in this process: run the cell"):
    pzp.load_model(ckpt, allow_modules=["__main__"])
