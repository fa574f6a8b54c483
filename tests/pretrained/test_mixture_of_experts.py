"""The mixture-of-experts layer (`pz_persist.nn.mixture_of_experts`):
each routing rule against a NumPy reference written from the families'
descriptions (a per-token loop over the chosen experts, as transformers
computes), the experts' activations, Llama 4's input weighting, shared experts
and their gate, and a save_model / load_model round trip."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import pz_persist
from pz_persist.nn import mixture_of_experts as moe

E, D, N, T = 8, 6, 5, 7  # Experts, embedding, neurons, tokens.


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def _top(values, k):
  return list(np.argsort(-values, kind="stable")[:k])


def reference_weights(logits, rule, bias=None, expert_scale=None):
  """One token's {expert: weight}, as each family's router computes it."""
  k = rule["top_k"]
  score = rule.get("score", "softmax")
  scores = {"softmax": _softmax, "sigmoid": _sigmoid}.get(score, lambda x: x)(logits)
  choice = scores + (bias if bias is not None else 0)
  groups = rule.get("groups", 1)
  if groups > 1:
    per = E // groups
    group_scores = [np.sort(choice[g * per:(g + 1) * per])[-2:].sum() for g in range(groups)]
    kept = _top(np.array(group_scores), rule["top_groups"])
    choice = np.array([c if e // per in kept else -np.inf for e, c in enumerate(choice)])
  chosen = _top(choice, k)
  weights = scores[chosen]
  if score == "softmax_of_chosen":
    weights = _softmax(weights)
  if rule.get("normalize"):
    weights = weights / (weights.sum() + rule.get("normalize_epsilon", 0.0))
  weights = weights * rule.get("scale", 1.0)
  if expert_scale is not None:
    weights = weights * expert_scale[chosen]
  return dict(zip(chosen, weights))


RULES = {
    "qwen3_moe": {"top_k": 2, "normalize": False},
    "qwen3_moe_norm": {"top_k": 3, "normalize": True},
    "mixtral": {"top_k": 2, "normalize": True},
    "gpt_oss": {"top_k": 2, "score": "softmax_of_chosen"},
    "llama4": {"top_k": 1, "score": "sigmoid"},
    "deepseek_v3": {"top_k": 3, "score": "sigmoid", "normalize": True,
                    "normalize_epsilon": 1e-20, "scale": 2.5, "groups": 4, "top_groups": 2},
    "gemma4": {"top_k": 2, "normalize": True},
}


def _param(label, value, *axes):
  return pz.Parameter(value=pz.nx.wrap(jnp.asarray(value, jnp.float32)).tag(*axes), label=label)


def _bind(layer, values):
  """Fills the slots of ``layer`` from ``{label: (array, axes)}``."""
  return pz.bind_variables(layer, [_param(label, v, *axes) for label, (v, axes) in values.items()])


@pytest.fixture(scope="module")
def rng():
  return np.random.default_rng(0)


def _router(rule, bias, rng, selection_bias=False, expert_scale=False):
  fields = dict(rule)
  router = moe.TopKRouter(
      logits=moe.router_linear("r", E, D, bias=bias), num_experts=E,
      selection_bias=moe.expert_vector("r_sel", E) if selection_bias else None,
      expert_scale=moe.expert_vector("r_scale", E) if expert_scale else None, **fields)
  values = {"r.weights": (rng.normal(size=(D, E)), ("embedding", "experts"))}
  if bias:
    values["r_bias.bias"] = (rng.normal(size=(E,)), ("experts",))
  if selection_bias:
    values["r_sel"] = (rng.normal(size=(E,)) * 0.1, ("experts",))
  if expert_scale:
    values["r_scale"] = (rng.uniform(0.5, 2, size=(E,)), ("experts",))
  return _bind(router, values), values


@pytest.mark.parametrize("family", sorted(RULES))
def test_routing_rule_matches_reference(family, rng):
  rule = RULES[family]
  router, values = _router(rule, bias=family == "gpt_oss", rng=rng,
                           selection_bias=family == "deepseek_v3",
                           expert_scale=family == "gemma4")
  x = rng.normal(size=(T, D)).astype(np.float32)
  got = np.asarray(router(pz.nx.wrap(jnp.asarray(x)).tag("seq", "embedding")).unwrap(
      "seq", "experts"))
  logits = x @ values["r.weights"][0]
  if "r_bias.bias" in values:
    logits = logits + values["r_bias.bias"][0]
  bias = values.get("r_sel", (None,))[0]
  scale = values.get("r_scale", (None,))[0]
  for t in range(T):
    expected = np.zeros(E)
    for e, w in reference_weights(logits[t], rule, bias, scale).items():
      expected[e] = w
    np.testing.assert_allclose(got[t], expected, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(got[t]) == rule["top_k"]


def test_selection_bias_changes_choice_not_weights(rng):
  """DeepSeek's correction bias picks the experts; the weights are the
  unbiased scores: a large bias on one expert makes it chosen, with its
  unbiased sigmoid score (renormalised)."""
  rule = {"top_k": 2, "score": "sigmoid"}
  router, values = _router(rule, bias=False, rng=rng, selection_bias=True)
  x = rng.normal(size=(T, D)).astype(np.float32)
  biased = np.zeros(E, np.float32)
  biased[5] = 100.0
  router = _bind(pz.unbind_params(router)[0], {**values, "r_sel": (biased, ("experts",))})
  got = np.asarray(router(pz.nx.wrap(jnp.asarray(x)).tag("seq", "embedding")).unwrap(
      "seq", "experts"))
  logits = x @ values["r.weights"][0]
  np.testing.assert_allclose(got[:, 5], _sigmoid(logits[:, 5]), rtol=1e-5)


def _experts_values(rng, biases=False):
  values = {
      "x/gate.weights": (rng.normal(size=(E, D, N)), ("experts", "embedding", "neurons")),
      "x/up.weights": (rng.normal(size=(E, D, N)), ("experts", "embedding", "neurons")),
      "x/down.weights": (rng.normal(size=(E, N, D)), ("experts", "neurons", "embedding")),
  }
  if biases:
    values.update({
        "x/gate_bias.bias": (rng.normal(size=(E, N)), ("experts", "neurons")),
        "x/up_bias.bias": (rng.normal(size=(E, N)), ("experts", "neurons")),
        "x/down_bias.bias": (rng.normal(size=(E, D)), ("experts", "embedding")),
    })
  return values


def _reference_expert(values, e, x, activation, alpha=1.702, limit=7.0):
  g = x @ values["x/gate.weights"][0][e]
  u = x @ values["x/up.weights"][0][e]
  if "x/gate_bias.bias" in values:
    g, u = g + values["x/gate_bias.bias"][0][e], u + values["x/up_bias.bias"][0][e]
  if activation == "silu":
    h = g * _sigmoid(g) * u
  elif activation == "gelu_tanh":
    h = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
  else:  # clamped_swiglu (gpt-oss)
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    h = g * _sigmoid(alpha * g) * (u + 1)
  out = h @ values["x/down.weights"][0][e]
  if "x/down_bias.bias" in values:
    out = out + values["x/down_bias.bias"][0][e]
  return out


@pytest.mark.parametrize("activation,biases,family", [
    ("silu", False, "mixtral"), ("gelu_tanh", False, "gemma4"),
    ("clamped_swiglu", True, "gpt_oss")])
def test_mixture_matches_per_token_reference(activation, biases, family, rng):
  rule = RULES[family]
  router, r_values = _router(rule, bias=family == "gpt_oss", rng=rng)
  values = _experts_values(rng, biases)
  layer = moe.MixtureOfExperts(
      router=router, experts=moe.experts_mlp("x", E, D, N, activation=activation,
                                             biases=biases, limit=1.5))
  layer = _bind(layer, values)
  x = rng.normal(size=(T, D)).astype(np.float32)
  got = np.asarray(layer(pz.nx.wrap(jnp.asarray(x)).tag("seq", "embedding")).unwrap(
      "seq", "embedding"))
  logits = x @ r_values["r.weights"][0] + r_values.get("r_bias.bias", (0,))[0]
  for t in range(T):
    expected = sum(w * _reference_expert(values, e, x[t], activation, limit=1.5)
                   for e, w in reference_weights(logits[t], rule).items())
    np.testing.assert_allclose(got[t], expected, rtol=1e-4, atol=1e-4)


def test_llama4_weights_inputs_and_adds_shared_expert(rng):
  """Llama 4: the sigmoid score multiplies the chosen expert's input, and a
  shared expert is always added; also a sigmoid-gated shared expert (Qwen)."""
  rule = RULES["llama4"]
  router, r_values = _router(rule, bias=False, rng=rng)
  values = _experts_values(rng)
  shared = moe.experts_mlp("s", 1, D, N)  # A one-expert MLP stands in for a shared MLP.
  shared_values = {k.replace("x/", "s/"): (v[:1], axes) for k, (v, axes) in
                   _experts_values(rng).items()}
  shared_layer = pz.nn.Sequential([shared, pz.nn.Elementwise(lambda x: x)])
  layer = moe.MixtureOfExperts(
      router=router, weight_inputs=True,
      experts=moe.experts_mlp("x", E, D, N, inputs_have_experts=True),
      shared=pz.nn.Sequential([shared_layer, _SumExperts()]),
      shared_gate=pz.nn.Linear.from_config(name="g", init_base_rng=None,
                                           input_axes={"embedding": D}, output_axes={}))
  gate = rng.normal(size=(D,))
  layer = _bind(layer, {**values, **shared_values, "g.weights": (gate, ("embedding",))})
  x = rng.normal(size=(T, D)).astype(np.float32)
  got = np.asarray(layer(pz.nx.wrap(jnp.asarray(x)).tag("seq", "embedding")).unwrap(
      "seq", "embedding"))
  logits = x @ r_values["r.weights"][0]
  shared_ref = {k.replace("s/", "x/"): v for k, v in shared_values.items()}
  for t in range(T):
    routed = sum(_reference_expert(values, e, w * x[t], "silu")
                 for e, w in reference_weights(logits[t], rule).items())
    expected = routed + _sigmoid(x[t] @ gate) * _reference_expert(shared_ref, 0, x[t], "silu")
    np.testing.assert_allclose(got[t], expected, rtol=1e-4, atol=1e-4)


@pz.pytree_dataclass
class _SumExperts(pz.nn.Layer):
  def __call__(self, x, **_):
    return x.untag("experts").sum()


def test_save_model_round_trip_and_treescope_axes(rng, tmp_path):
  """Savable as every pretrained layer is (allow-listed), and its
  parameters carry the ``experts`` axis treescope shows."""
  rule = RULES["deepseek_v3"]
  router, r_values = _router(rule, bias=False, rng=rng, selection_bias=True, expert_scale=True)
  layer = _bind(moe.MixtureOfExperts(
      router=pz.unbind_params(router)[0],
      experts=moe.experts_mlp("x", E, D, N, activation="clamped_swiglu", biases=True)),
      {**r_values, **_experts_values(rng, biases=True)})
  pz_persist.save_model(tmp_path / "ckpt", layer)
  back = pz_persist.load_model(tmp_path / "ckpt")
  x = pz.nx.wrap(jnp.asarray(rng.normal(size=(T, D)), jnp.float32)).tag("seq", "embedding")
  np.testing.assert_array_equal(np.asarray(back(x).unwrap("seq", "embedding")),
                                np.asarray(layer(x).unwrap("seq", "embedding")))
  assert dataclasses.asdict(back.router) is not None
  params = {p.label: p.value for p in pz.unbind_params(layer)[1]}
  assert "experts" in params["x/gate.weights"].named_shape
  import treescope
  assert "experts" in treescope.render_to_text(layer)
