"""load_into(path, model) reads each array straight into the model's own
sharding (8 CPU devices): a model larger than one device loads into itself.

Every array the read produces is checked where it lands: none may be placed
whole on one device (the default device, typically) on its way to the mesh,
whatever the load has to do on the way (transpose stored axes, rename axes,
cast dtypes, or read arrays saved as NumPy arrays).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz
from penzai.models import simple_mlp
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist.format import array_specs as arrays_lib

RULES = {"features": "model", "features_out": "data"}
"""Every parameter of the MLP below is sharded by these: none is whole on any
device once placed (each bias over "model", each weight over both)."""


WEIGHTS = {"mlp/Affine_0/Linear.weights", "mlp/Affine_1/Linear.weights"}


def _mlp(seed: int = 0) -> pz.nn.Layer:
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(seed), feature_sizes=[8, 32, 16]
  )


def _sharded(model: pz.nn.Layer) -> pz.nn.Layer:
  """``model`` with every parameter placed on a 2x4 mesh by axis names."""
  assert jax.device_count() == 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  rules = pzp.AxisRules(mesh, RULES)
  unbound, params = pz.unbind_params(model, freeze=True)
  placed = []
  for param in params:
    view = param.value.as_namedarrayview()
    dims = [None] * len(view.data_shape)
    for name, dim in view.data_axis_for_name.items():
      dims[dim] = name
    sharding = rules.sharding(tuple(dims), view.data_shape, what=param.label)
    value = dataclasses.replace(
        param.value, data_array=jax.device_put(param.value.data_array, sharding)
    )
    placed.append(dataclasses.replace(param, value=value))
  return pz.bind_variables(unbound, placed, unfreeze_as_copy=True)


def _params(model) -> dict:
  return {p.label: p.value for p in pz.unbind_params(model, freeze=True)[1]}


def _whole_on_one_device(x) -> bool:
  return isinstance(x, jax.Array) and x.size > 1 and any(
      shard.data.size == x.size for shard in x.addressable_shards
  )


class _Placements:
  """What a load placed where: every array the read produced (before
  conversion: what was read), and the shapes of whole arrays sent to one
  device, by ``jax.device_put`` or from the host by ``jnp.asarray``."""

  def __init__(self, monkeypatch):
    self.read: list = []
    self.whole_puts: list = []
    self._monkeypatch = monkeypatch

  @contextlib.contextmanager
  def recording(self):
    from_storage, device_put, asarray = arrays_lib.from_storage, jax.device_put, jnp.asarray

    def recording_from_storage(value, spec):
      self.read.append((spec.label, value))
      return from_storage(value, spec)

    def recording_device_put(x, device=None, *args, **kwargs):
      single = isinstance(device, jax.Device) or (
          isinstance(device, jax.sharding.Sharding) and len(device.device_set) == 1
      )
      if single:
        self.whole_puts.extend(
            np.shape(leaf) for leaf in jax.tree.leaves(x) if np.size(leaf) > 1
        )
      return device_put(x, device, *args, **kwargs)

    def recording_asarray(x, *args, **kwargs):  # Host data to the default device.
      if isinstance(x, np.ndarray) and x.size > 1:
        self.whole_puts.append(x.shape)
      return asarray(x, *args, **kwargs)

    with self._monkeypatch.context() as patch:
      patch.setattr(arrays_lib, "from_storage", recording_from_storage)
      patch.setattr(jax, "device_put", recording_device_put)
      patch.setattr(jnp, "asarray", recording_asarray)
      yield


@pytest.fixture
def placements(monkeypatch) -> _Placements:
  return _Placements(monkeypatch)


def _check_placed_like(loaded, model, placements: _Placements) -> None:
  assert placements.read, "no array was read"
  assert placements.whole_puts == [], "arrays were placed whole on one device"
  whole = [label for label, value in placements.read if _whole_on_one_device(value)]
  assert whole == [], "arrays were read whole onto one device"
  expected = _params(model)
  for label, value in _params(loaded).items():
    assert value.data_array.sharding == expected[label].data_array.sharding, label
    assert not _whole_on_one_device(value.data_array), label


def test_arrays_are_read_straight_into_the_models_sharding(ckpt, placements):
  saved = _mlp(seed=0)
  pzp.save_model(ckpt, saved)
  model = _sharded(_mlp(seed=1))

  with placements.recording():
    loaded = pzp.load_into(ckpt, model)

  _check_placed_like(loaded, model, placements)
  assert_identical(
      jax.tree.map(np.asarray, _params(loaded)), jax.tree.map(np.asarray, _params(saved))
  )


def _reversed_and_renamed(param):
  """The parameter with its axes stored in reverse order, and "features_out"
  stored as "out"."""
  value = param.value.order_as(*reversed(list(param.value.named_axes)))
  if "features_out" in value.named_axes:
    value = value.untag(*value.named_axes).tag(
        *("out" if name == "features_out" else name for name in value.named_axes)
    )
  return dataclasses.replace(param, value=value)


def test_transposed_and_renamed_axes_are_read_in_the_permuted_sharding(ckpt, placements):
  saved = _mlp(seed=0)
  params = pz.unbind_params(saved, freeze=True)[1]
  stored = [_reversed_and_renamed(p) for p in params]
  assert any(p.value.data_array.shape != q.value.data_array.shape
             for p, q in zip(params, stored)), "nothing to transpose"
  pzp.save(ckpt, tuple(stored))
  model = _sharded(_mlp(seed=1))

  with placements.recording():
    loaded, report = pzp.load_into(
        ckpt, model, rename_axes={"out": "features_out"}, strict=False
    )

  assert report.ok and set(report.transposed) >= WEIGHTS
  _check_placed_like(loaded, model, placements)
  for label, value in _params(loaded).items():
    expected = _params(saved)[label]
    np.testing.assert_array_equal(
        np.asarray(value.data_array), np.asarray(expected.data_array), err_msg=label
    )


def test_a_cast_runs_on_the_shards(ckpt, placements):
  saved = _mlp(seed=0)
  pzp.save_model(ckpt, saved)
  model = _sharded(_mlp(seed=1))

  with placements.recording():
    loaded, report = pzp.load_into(ckpt, model, dtype=jnp.bfloat16, strict=False)

  assert report.ok and len(report.cast) == 4
  _check_placed_like(loaded, model, placements)
  for label, value in _params(loaded).items():
    assert value.dtype == jnp.bfloat16, label
    np.testing.assert_array_equal(
        np.asarray(value.data_array),
        np.asarray(_params(saved)[label].data_array.astype(jnp.bfloat16)),
    )


def test_arrays_saved_as_numpy_go_from_the_host_to_the_shards(ckpt, placements):
  """NumPy arrays are read to the host; transposed there, then sent to the
  model's shards, never whole to one device first."""
  saved = _mlp(seed=0)
  as_numpy = [
      dataclasses.replace(p, value=dataclasses.replace(
          p.value, data_array=np.asarray(p.value.data_array)
      ))
      for p in map(_reversed_and_renamed, pz.unbind_params(saved, freeze=True)[1])
  ]
  pzp.save(ckpt, tuple(as_numpy))
  model = _sharded(_mlp(seed=1))

  with placements.recording():
    loaded, report = pzp.load_into(
        ckpt, model, rename_axes={"out": "features_out"}, strict=False
    )

  assert report.ok and set(report.transposed) >= WEIGHTS
  assert all(isinstance(value, np.ndarray) for _, value in placements.read)
  _check_placed_like(loaded, model, placements)
  for label, value in _params(loaded).items():
    np.testing.assert_array_equal(
        np.asarray(value.data_array), np.asarray(_params(saved)[label].data_array),
        err_msg=label,
    )


def test_a_sharding_given_still_wins(ckpt):
  pzp.save_model(ckpt, _mlp(seed=0))
  model = _sharded(_mlp(seed=1))
  device = jax.devices()[3]
  loaded = pzp.load_into(
      ckpt, model, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  for label, value in _params(loaded).items():
    assert value.data_array.devices() == {device}, label
