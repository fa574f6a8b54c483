"""A name in a checkpoint finds only what the allow-list allows in its own right (issue 26).

Two holes, each closed as a class in `pz_persist.format.code_references`:

* Private attributes reached through a qualified name. Only dunder parts were
  refused, so ``partial(jax.scipy.stats.gaussian_kde._setattr, jax.nn.relu,
  "fun")`` as an ``Elementwise`` activation broke ``jax.nn.relu`` for the whole
  process when the loaded model ran, and the same gadget rewrote the value of
  Penzai's ``LayerStackVarBehavior.SHARED``. No part of a name may be private
  now, and a function found through a class is a method: refused by default.
* An allowed module lent whatever it imported. A user module doing ``from
  numpy import memmap, save``, allowed with ``allow_modules``, let a checkpoint
  call ``memmap`` (truncating a file) or ``save``. Every object found is now
  judged as itself: loading computes the object's own reference with the very
  function saving uses and refuses it unless saving could have written it.

The catalogue (`hostile/catalogue.py`) holds these checkpoints too, so every
loader and Orbax v1 refuse each; here: the end-to-end gadgets through every
entry point in a fresh process (a process the hole reached would be broken
for the tests that follow), and the save side.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import manifest_json
import pytest
from conftest import REPO
from penzai import pz

import pz_persist as pzp
from hostile import catalogue
from pz_persist import errors
from pz_persist.format import code_references

TIMEOUT = 300

# Every entry point, in a fresh interpreter: each must refuse, and afterwards
# jax.nn.relu and LayerStackVarBehavior.SHARED must be what they were.
_ENTRY_POINTS = """
import json, subprocess, sys
import jax, jax.numpy as jnp
import jax.scipy.stats  # As any program using it has: the gadget's module is imported.
import orbax.checkpoint as ocp
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz
import pz_persist as pzp
import model_zoo
ckpt, run = sys.argv[1], sys.argv[2]

def attempt(name, fn):
  try:
    loaded = fn()
    print(name, "LOADED")
    if name == "load_model":
      loaded(model_zoo.mlp_input())  # What the hole did: running it.
  except pzp.errors.PzPersistError as e:
    print(name, "refused", type(e).__name__, str(e).replace("\\n", " "))

attempt("load", lambda: pzp.load(ckpt))
attempt("inspect", lambda: pzp.inspect(ckpt))
attempt("load_model", lambda: pzp.load_model(ckpt))
attempt("v1", lambda: ocp_v1.load_checkpointables(ckpt)["penzai"])
with ocp.CheckpointManager(run) as manager:
  attempt("orbax_v0", lambda: manager.restore(1, args=ocp.args.Composite(
      penzai=pzp.PenzaiRestore()))["penzai"])
with pzp.CheckpointManager(run) as manager:
  attempt("manager", lambda: manager.restore(1)["penzai"])
cli = subprocess.run([sys.executable, "-m", "pz_persist.tools.cli", "inspect", ckpt,
                      "--html", ckpt + ".html"], capture_output=True, text=True)
print("cli", cli.returncode, cli.stderr.replace("\\n", " ")[-600:])
print("relu(-1) =", float(jax.nn.relu(jnp.float32(-1.0))))
print("SHARED =", pz.nn.LayerStackVarBehavior.SHARED.value)
print("END")
"""

_GADGETS = {
    "relu_rewritten": catalogue._partial(  # pylint: disable=protected-access
        catalogue.SETATTR, catalogue._fn("jax.nn", "relu"),  # pylint: disable=protected-access
        {"t": "str", "v": "fun"}),
    "enum_value_rewritten": catalogue._partial(  # pylint: disable=protected-access
        catalogue.SETATTR, catalogue.SHARED, {"t": "str", "v": "_value_"}),
}


def _forge_both(tmp_path, node) -> tuple[str, str]:
  """The MLP saved as a checkpoint and as step 1 (item ``penzai``) of a
  manager run, each with ``node`` as its Elementwise layer's function."""
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  catalogue.set_fn_node(node)(ckpt, None)
  run = tmp_path / "run"
  with pzp.CheckpointManager(run) as manager:
    manager.save(1, penzai=model_zoo.mlp())
  catalogue.set_fn_node(node)(run / "1", None)
  return str(ckpt), str(run)


@pytest.mark.parametrize("gadget", _GADGETS)
def test_private_setattr_gadget_is_refused_by_every_entry_point(gadget, tmp_path):
  ckpt, run = _forge_both(tmp_path, _GADGETS[gadget])
  result = subprocess.run(
      [sys.executable, "-c", textwrap.dedent(_ENTRY_POINTS), ckpt, run],
      capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO,
      env={**__import__("os").environ, "PYTHONPATH": f"{REPO}:{REPO}/tests"},
  )
  out = result.stdout
  assert result.returncode == 0 and out.rstrip().endswith("END"), (
      result.returncode, out, result.stderr[-3000:])
  for name in ("load", "inspect", "load_model", "v1", "orbax_v0", "manager"):
    (line,) = [line for line in out.splitlines() if line.startswith(f"{name} ")]
    assert "refused ManifestError" in line, line
    assert "tree.sublayers[1].fn.func: refusing private name" in line, line
    assert "gaussian_kde._setattr (part '_setattr')" in line, line
  assert "cli 2 " in out and "refusing private name" in out, out
  assert "relu(-1) = 0.0" in out and "SHARED = 1" in out, out


def test_private_setattr_gadget_is_refused_at_save(ckpt):
  setattr_ = jax.scipy.stats.gaussian_kde._setattr  # pylint: disable=protected-access
  for target, name in ((jax.nn.relu, "fun"), (pz.nn.LayerStackVarBehavior.SHARED, "_value_")):
    model = pz.nn.Sequential([pz.nn.Elementwise(functools.partial(setattr_, target, name))])
    with pytest.raises(
        errors.DisallowedModuleError,
        match=r"tree\.sublayers\[0\]\.fn\.func: jax\._src\.scipy\.stats\.kde\.gaussian_kde"
        r"\._setattr has the private name part '_setattr'",
    ):
      pzp.save_model(ckpt, model)
    assert not ckpt.exists()


def test_methods_of_allowed_classes_are_refused_at_save(ckpt):
  """A method's first argument could be bound to a process-wide object."""
  model = pz.nn.Sequential([pz.nn.Elementwise(jax.scipy.stats.gaussian_kde.evaluate)])
  with pytest.raises(errors.DisallowedModuleError, match=r"tree\.sublayers\[0\]\.fn: .*evaluate"):
    pzp.save_model(ckpt, model)


@pytest.fixture
def reexports(tmp_path, monkeypatch):
  """A user module importing from NumPy, allowed for the whole test."""
  folder = tmp_path / "user_code"
  folder.mkdir()
  (folder / "my_reexports.py").write_text(
      "from numpy import memmap, save\nimport jax\nrelu = jax.nn.relu\n"
  )
  monkeypatch.syspath_prepend(str(folder))
  import my_reexports  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  monkeypatch.setitem(sys.modules, "my_reexports", my_reexports)
  return my_reexports


def test_what_an_allowed_module_imported_is_refused_at_save(reexports, ckpt, tmp_path):
  marker = tmp_path / "marker.bin"
  marker.write_bytes(b"precious bytes")
  cases = {
      r"tree\.sublayers\[0\]\.fn\.func: the class numpy\.memmap is held as a value":
          functools.partial(reexports.memmap, str(marker), "uint8", "w+"),
      r"tree\.sublayers\[0\]\.fn: the function numpy\.save may not be named": reexports.save,
  }
  for match, fn in cases.items():
    model = pz.nn.Sequential([pz.nn.Elementwise(fn)])
    with pytest.raises(errors.DisallowedModuleError, match=match):
      pzp.save_model(ckpt, model, allow_modules=["my_reexports"])
    assert not ckpt.exists()
  assert marker.read_bytes() == b"precious bytes"


def test_a_harmless_reexport_loads_as_itself(reexports, tmp_path):
  """What a name finds is judged as itself: ``my_reexports.relu`` is
  ``jax.nn.relu``, allowed in its own right, so a checkpoint naming it loads."""
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  catalogue.set_fn("my_reexports", "relu")(ckpt, None)
  assert pzp.load_model(ckpt, allow_modules=["my_reexports"]).sublayers[1].fn is jax.nn.relu


def test_memmap_reexport_forged_into_a_manifest_leaves_the_file(reexports, tmp_path):
  marker = tmp_path / "marker.bin"
  marker.write_bytes(b"precious bytes")
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  node = catalogue._partial(  # pylint: disable=protected-access
      {"t": "type", "class": {"module": "my_reexports", "qualname": "memmap"}},
      *({"t": "str", "v": v} for v in (str(marker), "uint8", "w+")))
  catalogue.set_fn_node(node)(ckpt, None)
  for load in (pzp.load_model, pzp.load, pzp.inspect):
    with pytest.raises(errors.DisallowedModuleError, match=(
        r"tree\.sublayers\[1\]\.fn\.func: the class numpy\.memmap is held as a value.*"
        r"The checkpoint names it my_reexports\.memmap")):
      loaded = load(ckpt, allow_modules=["my_reexports"])
      if load is pzp.load_model:
        loaded(model_zoo.mlp_input())
  assert marker.read_bytes() == b"precious bytes"


@pytest.mark.parametrize("qualname, part", [
    ("gaussian_kde._setattr", "_setattr"),
    ("__class__", "__class__"),
    ("relu.__globals__", "__globals__"),
    ("_private", "_private"),
    ("public.and_._private.deeper", "_private"),
    ("public.name", None),
])
def test_private_part(qualname, part):
  assert code_references.private_part(qualname) == part


def test_every_default_function_is_allowed_as_itself():
  """The functions a model may hold by default keep loading: for each public
  module-level function of the callable modules the name saving gives it is
  accepted by loading, and no function that saving refuses gets through."""
  import jax.image  # pylint: disable=g-import-not-at-top,import-outside-toplevel,unused-import

  checked = 0
  for fn in (jax.nn.gelu, jax.nn.relu, jax.nn.silu, jax.nn.softmax, jnp.tanh, jnp.exp,
             np.add, jax.lax.rsqrt, jax.image.resize):
    ref = code_references.function_reference(fn, where="f")
    assert code_references.resolve_function(ref, where="f") is fn
    checked += 1
  assert checked == 9
  # NumPy's functions jax.numpy re-exports are NumPy's (no list of names needed).
  for qualname in ("array_repr", "can_cast", "iterable"):
    with pytest.raises(errors.DisallowedModuleError, match=(
        rf"f: the function numpy\.{qualname} may not be named.*The checkpoint names it"
        rf" jax\.numpy\.{qualname}")):
      code_references.resolve_function({"module": "jax.numpy", "qualname": qualname}, where="f")


def test_inspect_reports_the_refusal_as_json(tmp_path):
  """``inspect`` (no tree decoding needed for its tables) still refuses the tree."""
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  catalogue.set_fn_node(_GADGETS["relu_rewritten"])(ckpt, None)
  data = manifest_json.read(ckpt / "penzai" / "pz_persist.json")
  assert catalogue._elementwise(data)["fields"][0][1]["t"] == "partial"  # pylint: disable=protected-access
  with pytest.raises(errors.ManifestError, match="refusing private name"):
    pzp.inspect(ckpt)
