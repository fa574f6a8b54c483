"""xIELU, the activation with learned curvature of Apertus's MLP.

xIELU (Huang and Schlag, "Deriving Activation Functions Using Integration",
arXiv:2411.13010) is quadratic for positive inputs and saturates like an
ELU for negative ones, with two learned coefficients:

  ``x > 0``:  ``alpha_p * x**2 + beta * x``
  ``x <= 0``: ``alpha_n * (expm1(min(x, eps)) - x) + beta * x``

where ``alpha_p = softplus(a_p)`` and ``alpha_n = beta + softplus(a_n)`` keep
the coefficients in their ranges whatever the stored ``a_p``, ``a_n``.
Penzai has no such activation. transformers (``XIELUActivation``) stores
``a_p`` and ``a_n`` as parameters of shape ``(1,)``, learned per MLP, and
``beta`` (0.5) and ``eps`` (-1e-6) as buffers saved beside them; each layer
here holds all four as its own (scalar) parameters, read from and written
back to those tensors, so a stored ``beta`` or ``eps`` other than the
defaults is computed with, never replaced by the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from penzai import pz


@pz.pytree_dataclass
class XIELU(pz.nn.Layer):
  """Applies xIELU elementwise (module docstring), in the input's dtype.

  Attributes:
    alpha_p: ``a_p``, a scalar parameter (``softplus(a_p)`` multiplies
      ``x**2`` for positive inputs).
    alpha_n: ``a_n``, a scalar parameter (``beta + softplus(a_n)``
      multiplies the saturating part for non-positive inputs).
    beta: The linear coefficient, a scalar parameter.
    eps: Where the negative branch's ``expm1`` stops (a small negative
      number), a scalar parameter.

  Example::

    def scalar(label, value):
      return pz.Parameter(label=label, value=pz.nx.wrap(jnp.float32(value)))
    layer = XIELU(alpha_p=scalar("a_p", 0.5), alpha_n=scalar("a_n", 0.5),
                  beta=scalar("beta", 0.5), eps=scalar("eps", -1e-6))
    out = layer(pz.nx.wrap(jnp.array([-2.0, 0.0, 3.0]), "neurons"))
  """

  alpha_p: pz.ParameterLike[pz.nx.NamedArray]
  alpha_n: pz.ParameterLike[pz.nx.NamedArray]
  beta: pz.ParameterLike[pz.nx.NamedArray]
  eps: pz.ParameterLike[pz.nx.NamedArray]

  def __call__(self, value: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    dtype = value.dtype
    scalars = [p.value.unwrap().astype(dtype) for p in (self.alpha_p, self.alpha_n, self.beta,
                                                         self.eps)]
    return pz.nx.nmap(lambda x: _xielu(x, *scalars))(value)

  def treescope_color(self) -> str:
    return "#65cfbc"  # Penzai's colour for its own learned parameters (AddBias).


def _xielu(x: jax.Array, a_p: jax.Array, a_n: jax.Array, beta: jax.Array,
           eps: jax.Array) -> jax.Array:
  alpha_p = jax.nn.softplus(a_p)
  alpha_n = beta + jax.nn.softplus(a_n)
  positive = alpha_p * x * x + beta * x
  negative = (jnp.expm1(jnp.minimum(x, eps)) - x) * alpha_n + beta * x
  return jnp.where(x > 0, positive, negative)
