"""Code a checkpoint names is never run because it names it (issue #14).

Two holes, each closed as a class:

* Importing a module runs its code. A checkpoint naming ``numpy.f2py.__main__``
  made every loader run the f2py tool, which exited the process with status 0;
  naming NumPy's linalg tests reset NumPy's global random generator. Loading
  now finds names only among modules already imported, the few pz_persist
  lists and those the user allows, and refuses private, test and entry-point
  modules. These run in a fresh interpreter (a timeout and an address-space
  limit), since the failure being guarded against ends the process.
* A class held as a value is a callable. ``Elementwise(fn=partial(np.memmap,
  PATH, "uint8", "w+"))`` truncated PATH when the loaded model ran. Classes
  held as values (a field, a partial's function, metadata) must now be safe to
  call, at save time and at load time alike.
"""

from __future__ import annotations

import collections
import enum
import functools
import json
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import model_zoo
import numpy as np
import manifest_json
import pytest
from conftest import REPO
from penzai import pz

import pz_persist as pzp
from hostile import catalogue
from pz_persist import errors
from pz_persist.safety import allowlist

TIMEOUT = 180
ADDRESS_SPACE = 8 << 30  # JAX's CPU client reserves a lot; a runaway gets stopped.


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
  """Runs ``code`` in a fresh interpreter with a timeout and an address-space
  limit (set by the child itself: a ``preexec_fn`` would fork a multithreaded
  JAX process). Never raises: the exit status is what is tested."""
  limit = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE},) * 2)\n"
  return subprocess.run(
      [sys.executable, "-c", limit + textwrap.dedent(code), *argv],
      capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO,
  )


def _type_node(module: str, qualname: str) -> dict:
  return {"t": "type", "class": {"module": module, "qualname": qualname}}


def set_fn_node(node: dict) -> catalogue.Builder:
  """Makes the MLP's Elementwise layer (``tree.sublayers[1].fn``) hold ``node``."""
  return catalogue.edit(lambda m: catalogue._elementwise(m)["fields"][0].__setitem__(1, node))  # pylint: disable=protected-access


def _partial_node(func: dict, *args: dict) -> dict:
  return {"t": "partial", "func": func, "args": list(args), "keywords": []}


# Checkpoints naming modules that must not be imported: (builder, module
# named, regex of the refusal). Each is run through every loader in a fresh
# interpreter.
F2PY_MAIN = "numpy.f2py.__main__"
NUMPY_TEST = "numpy.linalg.tests.test_linalg"
PRIVATE = "penzai.core._treescope_handlers"
UNIMPORTED = "jax.experimental.ode"
PATH_RE = r"tree\.sublayers\[\d\](\.fn(\.func)?)?"
IMPORTING = {
    "layer_class_f2py_main": (catalogue.set_class(0, F2PY_MAIN, "main"), F2PY_MAIN,
                              r"part '__main__' of module 'numpy\.f2py\.__main__'"),
    "type_value_f2py_main": (set_fn_node(_type_node(F2PY_MAIN, "main")), F2PY_MAIN,
                             r"part '__main__'"),
    "layer_class_numpy_test": (catalogue.set_class(0, NUMPY_TEST, "TestSolve"), NUMPY_TEST,
                               r"part 'tests' of module 'numpy\.linalg\.tests\.test_linalg'"),
    "partial_of_numpy_test_class": (
        set_fn_node(_partial_node(_type_node(NUMPY_TEST, "TestSolve"))), NUMPY_TEST,
        r"part 'tests'"),
    "function_private_module": (catalogue.set_fn(PRIVATE, "struct_handler"), PRIVATE,
                                r"part '_treescope_handlers'"),
    "layer_class_private_module": (catalogue.set_class(0, PRIVATE, "Handler"), PRIVATE,
                                   r"part '_treescope_handlers'"),
    "layer_class_unimported_module": (
        catalogue.set_class(0, UNIMPORTED, "odeint"), UNIMPORTED,
        r"module 'jax\.experimental\.ode' is not imported.*allow_modules=\['jax\.experimental\.ode'\]"),
    "layer_class_main": (catalogue.set_class(0, "__main__", "Layer"), "__main__",
                         r"__main__\.Layer"),
}

_LOADERS_SCRIPT = """
import sys
import numpy as np
import pz_persist as pzp
path, module = sys.argv[1], sys.argv[2]
parts = module.split(".")
absent = [p for p in (".".join(parts[:i + 1]) for i in range(len(parts))) if p not in sys.modules]
np.random.seed(7)
state = np.random.get_state()[1].tobytes()
for name in ("load", "inspect", "load_model"):
  try:
    getattr(pzp, name)(path)
    print(name, "LOADED")
  except pzp.errors.PzPersistError as e:
    print(name, "refused", type(e).__name__, str(e).replace("\\n", " "))
  imported = [p for p in absent if p in sys.modules]
  same = np.random.get_state()[1].tobytes() == state
  print(name, "imported:", imported, "rng:", "same" if same else "CHANGED")
print("END")
"""


@pytest.fixture(scope="module")
def mlp_checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("base") / "ckpt"
  pzp.save_model(path, model_zoo.mlp())
  return path


def _forge(base, tmp_path, build) -> str:
  ckpt = tmp_path / "ckpt"
  shutil.copytree(base, ckpt)
  build(ckpt, None)
  return str(ckpt)


@pytest.mark.parametrize("case", IMPORTING)
def test_loaders_import_nothing_a_checkpoint_names(case, mlp_checkpoint, tmp_path):
  build, module, match = IMPORTING[case]
  ckpt = _forge(mlp_checkpoint, tmp_path, build)
  result = _run(_LOADERS_SCRIPT, ckpt, module)
  out = result.stdout
  assert result.returncode == 0 and out.rstrip().endswith("END"), (
      f"the process ended early ({result.returncode}):\n{out}\n{result.stderr[-3000:]}"
  )
  for name in ("load", "inspect", "load_model"):
    (refusal,) = [line for line in out.splitlines() if line.startswith(f"{name} refused")]
    assert "DisallowedModuleError" in refusal
    assert re.search(PATH_RE + ": .*" + match, refusal), refusal
    assert f"{name} imported: [] rng: same" in out, out


@pytest.mark.parametrize("case", ["layer_class_f2py_main", "layer_class_numpy_test"])
def test_cli_inspect_imports_nothing_a_checkpoint_names(case, mlp_checkpoint, tmp_path):
  """``inspect`` prints the manifest's tables; ``--html`` decodes the tree."""
  build, _, match = IMPORTING[case]
  ckpt = _forge(mlp_checkpoint, tmp_path, build)
  cli = "import sys; from pz_persist.tools import cli; sys.exit(cli.main(sys.argv[1:]))"
  result = _run(cli, "inspect", ckpt)
  assert result.returncode == 0 and "in 4 arrays" in result.stdout, result
  html = tmp_path / "view.html"
  result = _run(cli, "inspect", ckpt, "--html", str(html))
  assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
  assert re.search(r"pz-persist: error: .*" + PATH_RE + ": .*" + match, result.stderr), (
      result.stderr)
  assert not html.exists()


def _user_modules(tmp_path) -> str:
  """A package of user code that misbehaves when imported or constructed."""
  (tmp_path / "exiting_on_import.py").write_text("raise SystemExit(0)\n")
  (tmp_path / "exiting_labels.py").write_text(textwrap.dedent("""
      import dataclasses
      @dataclasses.dataclass(frozen=True)
      class Label:
        group: str
        index: int
        def __post_init__(self):
          raise SystemExit(0)
  """))
  return str(tmp_path)


def test_code_run_for_a_checkpoint_never_exits_the_process(mlp_checkpoint, tmp_path):
  """Modules and classes the user allowed run their code; a SystemExit from it
  is a ManifestError naming the tree path, not the end of the program."""
  ckpt = _forge(mlp_checkpoint, tmp_path, catalogue.set_class(0, "exiting_on_import", "Layer"))
  labels = tmp_path / "labels"
  labels.mkdir()
  labels_ckpt = labels / "ckpt"
  pzp.save(labels_ckpt, {"label": pz.ScopedStateVarLabel(group="g", index=0)})
  data = manifest_json.read(labels_ckpt / "penzai" / "pz_persist.json")
  data["tree"]["items"][0][1]["class"] = {"module": "exiting_labels", "qualname": "Label"}
  (labels_ckpt / "penzai" / "pz_persist.json").write_text(json.dumps(data))
  result = _run(f"""
      import sys
      sys.path.insert(0, {_user_modules(tmp_path)!r})
      import pz_persist as pzp
      for path, module in (({ckpt!r}, "exiting_on_import"), ({str(labels_ckpt)!r}, "exiting_labels")):
        try:
          pzp.load(path, allow_modules=[module])
        except pzp.errors.ManifestError as e:
          print("refused:", e)
      print("END")
  """)
  assert result.returncode == 0 and result.stdout.rstrip().endswith("END"), (
      result.returncode, result.stdout, result.stderr[-3000:])
  assert re.search(
      r"tree\.sublayers\[0\]: importing module 'exiting_on_import' failed: SystemExit: 0",
      result.stdout), result.stdout
  assert re.search(
      r"tree\['label'\]: cannot rebuild Label: SystemExit: 0", result.stdout), result.stdout


# A class held as a value is a callable.


def test_memmap_partial_is_refused_at_save_naming_the_path(ckpt, tmp_path):
  marker = tmp_path / "marker.bin"
  marker.write_bytes(b"precious bytes")
  fn = functools.partial(np.memmap, str(marker), "uint8", "w+")
  model = pz.nn.Sequential([pz.nn.Identity(), pz.nn.Elementwise(fn)])
  with pytest.raises(
      errors.DisallowedModuleError,
      match=r"tree\.sublayers\[1\]\.fn\.func: the class numpy\.memmap is held as a value",
  ):
    pzp.save_model(ckpt, model)
  assert not ckpt.exists()
  assert marker.read_bytes() == b"precious bytes"


def test_memmap_partial_forged_into_a_manifest_is_refused(mlp_checkpoint, tmp_path):
  """Refused by every loader; the file it names keeps its bytes."""
  marker = tmp_path / "marker.bin"
  marker.write_bytes(b"precious bytes")
  node = _partial_node(
      _type_node("numpy", "memmap"),
      {"t": "str", "v": str(marker)}, {"t": "str", "v": "uint8"}, {"t": "str", "v": "w+"},
  )
  ckpt = _forge(mlp_checkpoint, tmp_path, set_fn_node(node))
  for load in (pzp.load_model, pzp.load, pzp.inspect):
    with pytest.raises(
        errors.DisallowedModuleError,
        match=r"tree\.sublayers\[1\]\.fn\.func: the class numpy\.memmap is held as a value",
    ):
      loaded = load(ckpt)
      if load is pzp.load_model:  # What the hole allowed: running truncates.
        loaded(model_zoo.mlp_input())
  assert marker.read_bytes() == b"precious bytes"


UNSAFE_CLASS_VALUES = {
    "numpy_memmap": (np.memmap, "numpy", "memmap"),
    "numpy_ndarray": (np.ndarray, "numpy", "ndarray"),
    "jax_array": (jax.Array, "jax", "Array"),
    "numpy_random_generator": (np.random.Generator, "numpy.random", "Generator"),
    "penzai_parameter": (pz.Parameter, "penzai.core.variables", "Parameter"),
}


@pytest.mark.parametrize("name", UNSAFE_CLASS_VALUES)
def test_unsafe_class_values_are_refused_at_save(name, ckpt):
  cls, module, qualname = UNSAFE_CLASS_VALUES[name]
  cases = {
      r"tree\.sublayers\[0\]\.fn": pz.nn.Sequential([pz.nn.Elementwise(cls)]),
      r"tree\['layer'\]\.fn\.keywords\['like'\]": {
          "layer": pz.nn.Elementwise(functools.partial(jnp.asarray, like=cls))
      },
      r"tree\[0\] \(label 'w'\)\.metadata\['factory'\]": [
          pz.ParameterValue(value=np.ones(2), label="w", metadata={"factory": cls})
      ],
  }
  for path, tree in cases.items():
    with pytest.raises(
        errors.DisallowedModuleError,
        match=path + rf": the class {module}\.{qualname} is held as a value",
    ):
      pzp.save(ckpt, tree)
    assert not ckpt.exists()


@pytest.mark.parametrize("name", UNSAFE_CLASS_VALUES)
def test_unsafe_class_values_forged_into_a_manifest_are_refused(name, mlp_checkpoint, tmp_path):
  _, module, qualname = UNSAFE_CLASS_VALUES[name]
  for i, node in enumerate([
      _type_node(module, qualname),
      _partial_node(_type_node(module, qualname)),
      {"t": "dict", "items": [[{"t": "str", "v": "k"}, _type_node(module, qualname)]]},
  ]):
    ckpt = _forge(mlp_checkpoint, tmp_path / str(i), set_fn_node(node))
    for load in (pzp.load_model, pzp.load, pzp.inspect):
      with pytest.raises(
          errors.DisallowedModuleError,
          match=rf"tree\.sublayers\[1\]\.fn\S*: the class {module}\.{qualname} is held",
      ):
        load(ckpt)


def test_setting_numpy_print_options_is_refused(ckpt):
  """A model calling it would change the process's NumPy print options."""
  with pytest.raises(errors.DisallowedModuleError, match=r"tree\.sublayers\[0\]\.fn: .*set_printoptions"):
    pzp.save_model(ckpt, pz.nn.Sequential([pz.nn.Elementwise(jnp.set_printoptions)]))


class Color(enum.Enum):
  RED = 1


Pair = collections.namedtuple("Pair", ["first", "second"])


def test_safe_class_values_round_trip(ckpt):
  """Scalar types, layer classes and Enums are held as values by real models."""
  tree = {
      "dtypes": [jnp.float32, jnp.bfloat16, np.float32, np.int8, ml_dtypes.bfloat16],
      "layer_class": pz.nn.Linear,
      "enum_class": pz.nn.LayerStackVarBehavior,
      "cast": pz.nn.CastToDType(jnp.bfloat16),
      "partial": pz.nn.Elementwise(functools.partial(jnp.asarray, dtype=np.float16)),
  }
  pzp.save(ckpt, tree)
  loaded = pzp.load(ckpt)
  assert loaded["dtypes"] == tree["dtypes"]
  assert loaded["layer_class"] is pz.nn.Linear
  assert loaded["enum_class"] is pz.nn.LayerStackVarBehavior
  assert loaded["cast"] == tree["cast"]
  assert loaded["partial"].fn.keywords == {"dtype": np.float16}


def test_user_allowed_classes_may_be_held_as_values(ckpt):
  """The user's own modules are theirs to trust, classes included."""
  tree = {"pair_class": Pair, "color_class": Color}
  with pytest.raises(errors.DisallowedModuleError, match=r"tree\['pair_class'\]"):
    pzp.save(ckpt, tree)
  pzp.save(ckpt, tree, allow_modules=[__name__])
  assert pzp.load(ckpt, allow_modules=[__name__]) == tree


# Which modules a checkpoint may name.


@pytest.mark.parametrize("module, part", [
    ("numpy.f2py.__main__", "__main__"),
    ("__main__", "__main__"),
    ("numpy.linalg.tests.test_linalg", "tests"),
    ("numpy.testing", "testing"),
    ("numpy._core.multiarray", "_core"),
    ("penzai.core._treescope_handlers", "_treescope_handlers"),
    # optax keeps some state classes in private modules `import optax` imports
    # (allowlist.PRIVATE_STATE_MODULES); its entry points and tests stay refused.
    ("optax.schedules._inject", None),
    ("optax.__main__", "__main__"),
    ("optax._src.alias_test", "alias_test"),
    ("my_project.test_layers", "test_layers"),
    ("my_project.layers_test", "layers_test"),
    ("my_project.conftest", "conftest"),
    ("my_project.setup", "setup"),
    ("penzai.nn.linear_and_affine", None),
    ("jax.numpy", None),
])
def test_refused_module_parts(module, part):
  assert allowlist.refused_part(module) == part


def test_parts_the_user_allowed_by_name_are_theirs():
  with allowlist.scoped_allowance(["my_tests._helpers", "my_project"]):
    assert allowlist.refused_part("my_tests._helpers") is None
    assert allowlist.refused_part("my_tests._helpers.deeper") is None
    assert allowlist.refused_part("my_tests._other") == "my_tests"
    assert allowlist.refused_part("my_project._secret") == "_secret"
    assert allowlist.refused_part("my_project.__main__") == "__main__"
  assert allowlist.refused_part("my_tests._helpers") == "my_tests"


def test_a_class_with_only_a_private_name_is_refused_at_save(ckpt, tmp_path):
  package = tmp_path / "userpkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "_impl.py").write_text(
      "import collections\nPoint = collections.namedtuple('Point', 'x y')\n"
  )
  sys.path.insert(0, str(tmp_path))
  try:
    from userpkg import _impl  # pylint: disable=g-import-not-at-top,import-outside-toplevel

    tree = {"p": _impl.Point(1, 2)}
    with pytest.raises(
        errors.DisallowedModuleError,
        match=r"tree\['p'\]: userpkg\._impl\.Point can only be named through module"
        r" 'userpkg\._impl'.*'_impl'.*allow_modules=\['userpkg\._impl'\]",
    ):
      pzp.save(ckpt, tree, allow_modules=["userpkg"])
    assert not ckpt.exists()
    pzp.save(ckpt, tree, allow_modules=["userpkg._impl"])
    assert pzp.load(ckpt, allow_modules=["userpkg._impl"]) == tree
  finally:
    sys.path.remove(str(tmp_path))
    for name in ("userpkg", "userpkg._impl"):
      sys.modules.pop(name, None)


def test_lazy_module_attributes_are_not_imported(mlp_checkpoint, tmp_path):
  """``numpy.testing`` is imported by NumPy's module ``__getattr__`` on first
  access: a reference descending through it must not trigger that."""
  ckpt = _forge(mlp_checkpoint, tmp_path, catalogue.set_class(0, "numpy", "testing.TestCase"))
  result = _run(f"""
      import sys
      import pz_persist as pzp
      assert "numpy.testing" not in sys.modules
      try:
        pzp.load({ckpt!r})
      except pzp.errors.PzPersistError as e:
        print(type(e).__name__, e)
      print("numpy.testing imported:", "numpy.testing" in sys.modules)
  """)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "ManifestError" in result.stdout and "tree.sublayers[0]" in result.stdout
  assert "numpy.testing imported: False" in result.stdout


def test_listed_modules_load_in_a_fresh_process(tmp_path):
  """Layers and optimizer states of modules `import pz_persist` does not
  import (simple_mlp, LoRA, optax) still load: pz_persist lists them."""
  ckpt = tmp_path / "ckpt"
  import optax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  from penzai.toolshed import lora  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  model = lora.loraify_linears_in_selection(
      pz.select(model_zoo.mlp()).at_instances_of(pz.nn.Linear),
      rank=2, init_base_rng=jax.random.key(3),
  )
  pzp.save_model(ckpt, model)
  opt = tmp_path / "opt"
  params = {p.label: p.value for p in pz.unbind_params(model, freeze=True)[1]}
  pzp.save(opt, optax.adamw(1e-3).init(params))
  result = _run(f"""
      import sys
      import pz_persist as pzp
      fresh = [m for m in ("optax", "penzai.models.simple_mlp", "penzai.toolshed.lora")
               if m not in sys.modules]
      print(type(pzp.load_model({str(ckpt)!r})).__name__, type(pzp.load({str(opt)!r})).__name__)
      print("fresh:", fresh)
  """)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "MLP tuple" in result.stdout
  assert "'penzai.toolshed.lora'" in result.stdout  # It was not imported before.
