"""Whole models, after surgery too, round-trip through save_model/load_model."""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import textwrap

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import manifest_json
import pytest
import surgery
import treescope
from conftest import run_python
from penzai import pz
from penzai.toolshed import lora
from treecompare import assert_same_model
from treecompare import assert_same_outputs

import pz_persist as pzp
from pz_persist import errors

MODELS = {
    "mlp": (model_zoo.mlp, model_zoo.mlp_input),
    "llamalike": (lambda: model_zoo.llamalike_transformer(layer_stack=False), model_zoo.tokens),
    "llamalike_layer_stack": (lambda: model_zoo.llamalike_transformer(layer_stack=True), model_zoo.tokens),
    "gemma_style": (model_zoo.gemma_style_transformer, model_zoo.tokens),
    "kv_caching_sampler": (
        lambda: model_zoo.sampling_model(model_zoo.llamalike_transformer(layer_stack=True)),
        lambda: model_zoo.tokens(length=3, offset=5),
    ),
    "after_surgery": (surgery.edited_transformer, model_zoo.tokens),
}


@pytest.mark.parametrize("build,make_input", MODELS.values(), ids=MODELS)
def test_model_round_trip(build, make_input, ckpt):
  model = build()
  pzp.save_model(ckpt, model)

  loaded = pzp.load_model(ckpt)

  assert_same_model(loaded, model)
  assert treescope.render_to_text(loaded) == treescope.render_to_text(model)
  assert_same_outputs(loaded(make_input()), model(make_input()))


def test_shared_parameter_stays_one_variable(ckpt):
  linear = pz.nn.Linear.from_config(
      name="tied", init_base_rng=jax.random.key(0),
      input_axes={"features": 4}, output_axes={"features_out": 4},
  )
  model = pz.nn.Sequential([linear, pz.nn.RenameAxes("features_out", "features"), linear])
  pzp.save_model(ckpt, model)

  loaded = pzp.load_model(ckpt)

  first, second = loaded.sublayers[0].weights, loaded.sublayers[2].weights
  assert isinstance(first, pz.Parameter) and first is second
  first.value = first.value * 2  # Still one variable: both layers see it.
  assert loaded.sublayers[2].weights.value is first.value


def _digest(outputs) -> str:
  return hashlib.sha256(np.asarray(outputs.data_array).tobytes()).hexdigest()


def test_edited_model_loads_in_a_fresh_process(ckpt):
  model = surgery.edited_transformer()
  pzp.save_model(ckpt, model)
  out = run_python(f"""
      import hashlib, sys
      import numpy as np
      sys.path.insert(0, "tests")
      import model_zoo
      import pz_persist as pzp
      model = pzp.load_model({str(ckpt)!r})
      outputs = model(model_zoo.tokens())
      print(type(model).__name__, hashlib.sha256(np.asarray(outputs.data_array).tobytes()).hexdigest())
  """)
  name, digest = out.strip().splitlines()[-1].split()
  assert name == "TransformerLM"
  assert digest == _digest(model(model_zoo.tokens()))


@pz.pytree_dataclass
class Doubler(pz.nn.Layer):
  """A user-defined layer, from a module that is not allow-listed."""

  factor: float = 2.0

  def __call__(self, x, **side_inputs):
    return x * self.factor


def test_user_layer_needs_its_module_allowed(ckpt):
  model = pz.nn.Sequential([model_zoo.mlp(), Doubler()])
  with pytest.raises(errors.DisallowedModuleError, match=r"tree\.sublayers\[1\].*Doubler.*allow_modules"):
    pzp.save_model(ckpt, model)
  assert not ckpt.exists()

  pzp.save_model(ckpt, model, allow_modules=[__name__])
  with pytest.raises(errors.DisallowedModuleError, match="Doubler"):
    pzp.load_model(ckpt)
  loaded = pzp.load_model(ckpt, allow_modules=[__name__])
  assert_same_outputs(loaded(model_zoo.mlp_input()), model(model_zoo.mlp_input()))


def _rewrite_manifest(ckpt, edit):
  path = ckpt / "penzai" / "pz_persist.json"
  manifest = manifest_json.read(path)
  edit(manifest)
  path.write_text(json.dumps(manifest))


def test_structure_naming_another_module_is_refused_without_importing_it(ckpt, tmp_path):
  """The module's import would leave a marker file: it must not appear."""
  marker = tmp_path / "imported.txt"
  (tmp_path / "side_effect_layers.py").write_text(textwrap.dedent(f"""
      open({str(marker)!r}, "w").write("imported")
      from penzai import pz
      @pz.pytree_dataclass
      class Layer(pz.nn.Layer):
        def __call__(self, x, **kw):
          return x
  """))
  sys.path.insert(0, str(tmp_path))
  try:
    pzp.save_model(ckpt, pz.nn.Sequential([model_zoo.mlp()]))
    _rewrite_manifest(ckpt, lambda m: m["tree"].update(
        {"class": {"module": "side_effect_layers", "qualname": "Layer"}}))
    for load in (pzp.load_model, pzp.load, pzp.inspect):
      with pytest.raises(errors.DisallowedModuleError, match="side_effect_layers"):
        load(ckpt)
    assert not marker.exists()
    assert "side_effect_layers" not in sys.modules
  finally:
    sys.path.remove(str(tmp_path))


@pytest.mark.parametrize(
    "function",
    [functools.partial(np.save, "/tmp/pz_persist_must_not_exist.npy"), jnp.save, print],
    ids=["partial-numpy-save", "jax-numpy-save", "print"],
)
def test_functions_that_could_do_harm_are_refused(function, ckpt):
  with pytest.raises(errors.DisallowedModuleError, match=r"tree\.sublayers\[0\]\.fn"):
    pzp.save_model(ckpt, pz.nn.Sequential([pz.nn.Elementwise(function)]))


def test_manifest_naming_a_harmful_function_is_refused(ckpt):
  pzp.save_model(ckpt, pz.nn.Sequential([pz.nn.Elementwise(jax.nn.relu)]))
  text = (ckpt / "penzai" / "pz_persist.json").read_text()
  assert '"qualname":"relu"' in text and '"module":"jax.nn"' in text  # Public name.
  (ckpt / "penzai" / "pz_persist.json").write_text(
      text.replace('"qualname":"relu"', '"qualname":"save"').replace(
          '"module":"jax.nn"', '"module":"jax.numpy"')
  )
  with pytest.raises(errors.DisallowedModuleError, match="jax.numpy.save"):
    pzp.load_model(ckpt)


def test_load_model_of_a_plain_tree_says_what_to_do(ckpt):
  pzp.save(ckpt, {"x": jnp.ones(2)})
  with pytest.raises(errors.PzPersistError, match=r"load_into\(path, model\)"):
    pzp.load_model(ckpt)


def test_save_model_wants_a_model(ckpt):
  with pytest.raises(TypeError, match="pz_persist.save"):
    pzp.save_model(ckpt, {"not": "a model"})


def test_load_model_with_dtype(ckpt):
  model = model_zoo.mlp()
  pzp.save_model(ckpt, model)
  loaded = pzp.load_model(ckpt, dtype=jnp.bfloat16)
  _, params = pz.unbind_params(loaded, freeze=True)
  assert {p.value.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}


def test_lora_model_in_bfloat16_with_skeleton_arrays(ckpt):
  """Skeleton arrays (RMS epsilon, attention scale) are saved with the model."""
  model = lora.loraify_linears_in_selection(
      pz.select(model_zoo.gemma_style_transformer()).at_instances_of(pz.nn.Linear),
      rank=2, init_base_rng=jax.random.key(3),
  )
  pzp.save_model(ckpt, model)
  manifest = manifest_json.read(ckpt / "penzai" / "pz_persist.json")
  skeleton = [a for a in manifest["arrays"] if "label" not in a]
  assert any(a["path"].endswith(".epsilon") for a in skeleton)
  assert_same_outputs(pzp.load_model(ckpt)(model_zoo.tokens()), model(model_zoo.tokens()))
