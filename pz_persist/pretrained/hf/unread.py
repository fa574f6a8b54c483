"""The one rule on a Hugging Face folder's stored tensors: each is read by the
family's plan, or declared by the family as knowingly left out, with why.

Why: transformers loads a folder holding tensors its model never reads with a
warning ("Some weights of the checkpoint were not used"); the model then
differs from what the files describe (a ``q_proj.bias`` where the config
says ``attention_bias: false``, a misspelled name, another model's tensors)
and nothing says so to whoever reads the logits. `load_hf` calls
`check_all_read` on every load, after the plan's tensors were checked
against the headers and before anything is read or built; export never calls
it (it writes exactly what a plan reads).

What is knowingly left out is declared in one place per family, next to
what it reads: `pz_persist.pretrained.hf.plan.Plan.left_out` (the towers of
a multimodal folder, multi-token-prediction layers) and
`pz_persist.pretrained.hf.record.ModelType.left_out` (the buffers
transformers' own class ignores, its ``_keys_to_ignore_on_load_unexpected``);
`ANY_FAMILY` holds the buffers transformers ignores for every model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.plan import LeftOut
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import left_out_matching
from pz_persist.pretrained.hf.weights import Weights

_log = logging.getLogger("pz_persist.pretrained.hf")

ANY_FAMILY: tuple[LeftOut, ...] = (
    left_out_matching(
        (r"(^|\.)rotary_emb\.(original_)?inv_freq$", r"(^|\.)position_ids$",
         r"(^|\.)num_batches_tracked$"),
        "buffers computed from the config (rotary inv_freq, position_ids, batch-norm counters)",
        "older transformers saved them; transformers ignores them on every model, and so does"
        " load_hf"),
)
"""Buffers transformers ignores whatever the model
(``PreTrainedModel._adjust_missing_and_unexpected_keys``: a rotary
embedding's ``inv_freq``, ``position_ids``), and batch-norm step counters."""

SHOWN = 5
"""How many unread tensors the error names (it also says how many in all)."""


def check_all_read(plan: Plan, weights: Weights, declared: Sequence[LeftOut],
                   model_type: str, *, allow: bool = False) -> None:
  """Refuses a folder storing a tensor that ``plan`` does not read and no
  declaration covers (``plan.left_out``, the record's ``declared``,
  `ANY_FAMILY`); then says, per reported declaration, what it left out.
  ``model_type``: the folder's, for the message. ``allow`` (the user's
  ``allow_unread=True``): warn with the same message instead of refusing.

  Reads only names (the headers, already open); nothing is built or read.

  Raises:
    UnreadTensorsError: naming the folder, the first `SHOWN` unread tensors,
      how many in all, and how to proceed.
  """
  views = {view.name: view for view in plan.views}
  read: set[str] = set()
  for spec in plan.tensors:
    view = views.get(spec.source)
    if view is None:
      read.add(spec.source)
    else:
      read.update(view.parts)
  stored = [name for name in weights.where if name not in views]
  declarations = (*plan.left_out, *declared, *ANY_FAMILY)
  left: dict[int, list[str]] = {}
  refused = []
  for name in sorted(stored):
    if name in read:
      continue
    index = next((i for i, left_out in enumerate(declarations) if left_out.covers(name)), None)
    if index is None:
      refused.append(name)
    else:
      left.setdefault(index, []).append(name)
  if refused and allow:
    _log.warning("%s They are left out, as allow_unread=True asks.",
                 _message(weights.path, refused, read, model_type, allowed=True))
  elif refused:
    raise errors.UnreadTensorsError(_message(weights.path, refused, read, model_type))
  for index, names in left.items():
    if declarations[index].reported:
      _report(weights.path, declarations[index], names)


def _message(path: str, refused: list[str], read: set[str], model_type: str,
             allowed: bool = False) -> str:
  shown = ", ".join(repr(name) for name in refused[:SHOWN])
  more = f" (and {len(refused) - SHOWN} more)" if len(refused) > SHOWN else ""
  hints = []
  biases = [name for name in refused
            if name.endswith(".bias") and name.removesuffix(".bias") + ".weight" in read]
  if biases:
    hints.append(f"{biases[0]!r} is a bias of a layer read without one: config.json turns that"
                 " bias off (attention_bias, mlp_bias, use_bias... false) while the files"
                 " hold it; set the field to what the files hold")
  hints.append("if config.json describes the model, the folder holds tensors of another model"
               " or misspelled names: remove or rename them (transformers would only warn"
               " 'Some weights of the checkpoint were not used' and drop them)")
  if not allowed:
    hints.append("to load the model without them anyway, as transformers does, pass"
                 " allow_unread=True (pz-persist convert hf: --allow-unread)")
  count = "1 stored tensor is" if len(refused) == 1 else f"{len(refused)} stored tensors are"
  return (f"{path}: {count} read by no part of the {model_type!r}"
          f" model its config.json describes, nor declared knowingly left out by its family:"
          f" {shown}{more}. Loading it would give a model other than the files describe."
          f" {'; '.join(hints)}.")


def _report(path: str, left_out: LeftOut, names: list[str]) -> None:
  """Warns how many tensors ``left_out`` covered, grouped by their top module
  (two name parts under ``model.``), e.g. ``"…: 12 tensors of the vision
  tower and projector (vision_tower.*) are not read: load_hf builds Gemma
  3's text model only."``"""
  groups = sorted({".".join(name.split(".", 2)[:2]) if name.startswith("model.")
                   else name.split(".", 1)[0] for name in names})
  _log.warning("%s: %d tensors of %s (%s) are not read: %s.", path, len(names), left_out.what,
               ", ".join(f"{group}.*" for group in groups), left_out.why)

