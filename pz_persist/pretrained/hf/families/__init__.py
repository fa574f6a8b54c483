"""One module per Hugging Face model family: how its ``config.json`` maps to
Penzai's config and which tensor fills each Penzai parameter.

`BUILDERS` is the one table `pz_persist.pretrained.hf.load_hf` dispatches on
(by ``model_type``); adding a family is adding a module and a row here.
"""

from __future__ import annotations

from collections.abc import Callable

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.families import gemma
from pz_persist.pretrained.hf.families import gpt_neox
from pz_persist.pretrained.hf.families import llama
from pz_persist.pretrained.hf.families import qwen2
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.weights import Weights

Builder = Callable[[Config, Weights], Plan]

BUILDERS: dict[str, Builder] = {
    "llama": llama.llama_plan,
    "mistral": llama.mistral_plan,
    "gpt_neox": gpt_neox.gpt_neox_plan,
    "qwen2": qwen2.qwen2_plan,
    "gemma": gemma.gemma_plan,
    "gemma2": gemma.gemma2_plan,
}
"""The supported ``model_type`` values of ``config.json`` and their mappings."""

REFUSED: dict[str, Callable[[str], str]] = {
    "gemma3": gemma.gemma3_refusal,
    "gemma3_text": gemma.gemma3_refusal,
}
"""``model_type`` values refused with a reason of their own (given the
``model_type``) rather than the list of supported ones."""
