"""Messages a user meets with a way forward, each followed to check it works.

A renamed field of a custom layer, a label prefix that changed, ``jax.jit(f)``
as an activation, combinations of ``Flag`` members, ``file://`` URLs and state
variables with automatic labels.
"""

from __future__ import annotations

import enum
import importlib
import re
import subprocess
import sys
import textwrap
import uuid

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import pytest
from penzai import pz
from penzai.models import simple_mlp

import pz_persist as pzp
from pz_persist import errors


def _module(directory, name, source):
  """Writes and imports module ``name`` from ``directory`` (a fresh copy)."""
  directory.mkdir(exist_ok=True)
  (directory / f"{name}.py").write_text(textwrap.dedent(source))
  sys.modules.pop(name, None)
  sys.path.insert(0, str(directory))
  try:
    importlib.invalidate_caches()
    return importlib.import_module(name)
  finally:
    sys.path.remove(str(directory))


_LAYER = """
    from penzai import pz

    @pz.pytree_dataclass
    class Scale(pz.nn.Layer):
      {field}: pz.nn.ParameterLike

      def __call__(self, x, **side_inputs):
        return x * self.{field}.value
"""


def test_a_renamed_field_of_a_layer_suggests_loading_into_the_new_model(tmp_path, monkeypatch):
  name = f"user_layers_{uuid.uuid4().hex[:8]}"
  old = _module(tmp_path / "v1", name, _LAYER.format(field="factor"))
  weight = pz.Parameter(value=pz.nx.wrap(jnp.arange(3.0)).tag("x"), label="scale/w")
  pzp.save_model(tmp_path / "ckpt", pz.nn.Sequential([old.Scale(weight)]), allow_modules=[name])

  new = _module(tmp_path / "v2", name, _LAYER.format(field="weight"))  # factor -> weight.
  monkeypatch.syspath_prepend(str(tmp_path / "v2"))
  with pytest.raises(errors.ManifestError) as caught:
    pzp.load_model(tmp_path / "ckpt", allow_modules=[name])
  message = str(caught.value)
  assert "tree.sublayers[0]: Scale has no field 'factor' (its fields are now weight)" in message
  assert "pz_persist.load_into(path, new_model)" in message

  fresh = pz.nn.Sequential([new.Scale(pz.Parameter(value=pz.nx.zeros({"x": 3}), label="scale/w"))])
  loaded = pzp.load_into(tmp_path / "ckpt", fresh)  # As the message says.
  np.testing.assert_array_equal(loaded.sublayers[0].weight.value.data_array, [0.0, 1.0, 2.0])


def test_a_changed_label_prefix_suggests_rename(tmp_path):
  pzp.save_model(tmp_path / "mlp", model_zoo.mlp())  # Labels mlp/...
  net = simple_mlp.MLP.from_config(name="net", init_base_rng=jax.random.key(1),
                                   feature_sizes=[8, 16, 8])
  with pytest.raises(errors.BindingError) as caught:
    pzp.load_into(tmp_path / "mlp", net)
  hint = re.search(r"hint: 4 label\(s\) not in the model match missing ones once their prefix"
                   r" 'mlp/' becomes 'net/': load_into\(path, model, rename=(\{.*\})\)",
                   str(caught.value))
  assert hint, str(caught.value)
  loaded = pzp.load_into(tmp_path / "mlp", net, rename=eval(hint[1]))  # noqa: S307 (ours)
  x = model_zoo.mlp_input()
  np.testing.assert_array_equal(loaded(x).data_array, model_zoo.mlp()(x).data_array)


def test_a_jitted_activation_says_what_to_do(tmp_path):
  model = pz.nn.Sequential([model_zoo.mlp(), pz.nn.Elementwise(jax.jit(jax.nn.relu))])
  with pytest.raises(errors.EncodingError) as caught:
    pzp.save_model(tmp_path / "m", model)
  message = str(caught.value)
  assert message.startswith("tree.sublayers[1].fn: a jax.jit-compiled function (jax.nn.relu)")
  assert "pz.nn.Elementwise(jax.nn.relu)" in message and "jax.jit(lambda model, x" in message
  assert not (tmp_path / "m").exists()
  pzp.save_model(tmp_path / "m", pz.nn.Sequential([model_zoo.mlp(),
                                                   pz.nn.Elementwise(jax.nn.relu)]))


class Mode(enum.IntFlag):
  READ = 1
  WRITE = 2
  EXEC = 4


class Color(enum.Flag):
  RED = enum.auto()
  GREEN = enum.auto()


@pytest.mark.parametrize("value", [
    Mode.READ | Mode.WRITE, Mode.READ | Mode.WRITE | Mode.EXEC, Mode(0), Mode.EXEC,
    Color.RED | Color.GREEN, Color(0),
], ids=["two", "three", "none", "one", "flag-two", "flag-none"])
def test_flag_combinations_round_trip(value, tmp_path):
  pzp.save(tmp_path / "f", {"mode": value}, allow_modules=[__name__])
  loaded = pzp.load(tmp_path / "f", allow_modules=[__name__])["mode"]
  assert loaded == value and type(loaded) is type(value)


def test_flag_values_outside_its_members_are_refused(tmp_path):
  with pytest.raises(errors.EncodingError, match=r"tree\['mode'\]: .* combination of its members"
                     r" \(READ, WRITE, EXEC\)"):
    pzp.save(tmp_path / "f", {"mode": Mode(8)}, allow_modules=[__name__])


def test_file_urls_are_local_paths(tmp_path):
  url = f"file://{tmp_path}"
  pzp.save(f"{url}/tree", {"w": jnp.arange(3)})
  assert (tmp_path / "tree").is_dir()
  np.testing.assert_array_equal(pzp.load(f"{url}/tree")["w"], [0, 1, 2])
  assert pzp.inspect(f"file://localhost{tmp_path}/tree")["w"].shape == (3,)
  pzp.save_model(f"{url}/model", model_zoo.mlp())
  assert pzp.verify(f"{url}/model").ok and pzp.diff(f"{url}/model", tmp_path / "model").identical
  assert type(pzp.load_model(f"{url}/model")).__name__ == "MLP"
  with pzp.CheckpointManager(f"{url}/run") as manager:
    manager.save(1, params=[jnp.ones(2)])
    manager.wait_until_finished()
    assert manager.all_steps() == [1]
  result = subprocess.run([sys.executable, "-m", "pz_persist.tools.cli", "ls", f"{url}/run"],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and "params*" in result.stdout, result.stderr
  with pytest.raises(errors.UnsupportedStorageError, match="file:// URL on host 'server'"):
    pzp.load(f"file://server{tmp_path}/tree")


@pz.pytree_dataclass
class Counter(pz.nn.Layer):
  """A layer with unlabelled state: Penzai gives it an AutoStateVarLabel."""

  count: pz.StateVariable
  total: pz.StateVariable

  def __call__(self, x, **side_inputs):
    return x


def _counter(count=0.0, total=0.0):
  return Counter(pz.StateVariable(value=jnp.asarray(count)),
                 pz.StateVariable(value=jnp.asarray(total)))


def test_automatic_state_labels_are_explained_and_matched_by_position(tmp_path):
  saved = _counter(3.0, 7.0)
  assert isinstance(saved.count.label, pz.AutoStateVarLabel)
  pzp.save_model(tmp_path / "c", saved, allow_modules=[__name__])
  fresh = _counter()
  with pytest.raises(errors.BindingError) as caught:
    pzp.load_into(tmp_path / "c", fresh, allow_modules=[__name__])
  message = str(caught.value)
  assert "hint: 2 of the model's state variables have automatic labels (AutoStateVarLabel)" in message
  assert "auto_labels='by_position'" in message
  loaded = pzp.load_into(tmp_path / "c", fresh, auto_labels="by_position",
                          allow_modules=[__name__])
  assert (float(loaded.count.value), float(loaded.total.value)) == (3.0, 7.0)
  assert loaded.count.label == fresh.count.label  # The model's own labels.
  with pytest.raises(errors.ArgumentError, match="the checkpoint has 2 and the model 3"):
    pzp.load_into(tmp_path / "c", pz.nn.Sequential([_counter(), Counter(
        pz.StateVariable(value=jnp.zeros(())), total=pz.StateVariable(value=jnp.zeros(()),
                                                                      label="kept"))]),
        auto_labels="by_position", allow_modules=[__name__])
