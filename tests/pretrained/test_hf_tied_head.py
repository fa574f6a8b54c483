"""``tie_word_embeddings: true`` beside a stored ``lm_head.weight``.

transformers 5 (``PreTrainedModel.tie_weights`` during ``from_pretrained``)
ties the head to the embeddings only when the checkpoint lacks the head or
holds it equal to the embeddings; a stored head that differs is used,
untied, with a warning. `load_hf` reads the stored head whenever there is
one (`pz_persist.pretrained.hf.config.lm_head_source`), which is that
choice in both cases. Gemma's Penzai model always ties, so a Gemma folder
storing a head is refused (`refuse_stored_head`) rather than read one way or
the other.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist import errors

_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64, "pad_token_id": 0}


def _tied_with_head(tmp_path, config_cls, model_cls, head_equals_embeddings: bool, **fields):
  """An untied random model saved with ``tie_word_embeddings`` set true in
  its ``config.json`` (both tables stored): the folder and transformers'
  reading of it."""
  torch.manual_seed(0)
  model = checks.randomized(model_cls(config_cls(**_SIZES, **fields,
                                                  tie_word_embeddings=False)))
  if head_equals_embeddings:
    with torch.no_grad():
      model.lm_head.weight.copy_(model.get_input_embeddings().weight)
  model.save_pretrained(tmp_path, safe_serialization=True)
  raw = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(dict(raw, tie_word_embeddings=True)))
  stored = safetensors.numpy.load_file(tmp_path / "model.safetensors")
  assert "lm_head.weight" in stored
  return transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()


@pytest.mark.parametrize("equal", [False, True], ids=["different", "equal"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_stored_head_is_read_as_transformers_5_reads_it(tmp_path, family, equal):
  config_cls, model_cls = {
      "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
  theirs = _tied_with_head(tmp_path, config_cls, model_cls, equal)
  stored = safetensors.numpy.load_file(tmp_path / "model.safetensors")
  head = theirs.lm_head.weight.detach().numpy()
  # transformers 5 itself: the stored head, tied only where it is the embeddings.
  np.testing.assert_array_equal(head, stored["lm_head.weight"])
  assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == equal
  error = checks.float32_error(tmp_path, checks.reference_logits(theirs))
  print(f"{family} tied + stored head ({'equal' if equal else 'different'}): float32 max abs"
        f" error {error:.2g}")


def test_the_stored_head_binds(tmp_path):
  """The embeddings as the head would give other logits (so the test above
  tells the two readings apart)."""
  theirs = _tied_with_head(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                           False)
  with torch.no_grad():
    theirs.lm_head.weight = theirs.model.embed_tokens.weight
  changed = checks.reference_logits(theirs)
  logits = checks.penzai_logits(pzp.pretrained.load_hf(tmp_path))
  assert np.abs(changed - logits).max() > 100 * checks.TOLERANCE["atol"]


def test_export_of_such_a_model_reloads_in_transformers(tmp_path):
  """The head read is not the embeddings, so the export says untied, and
  transformers computes the same logits from it."""
  theirs = _tied_with_head(tmp_path / "src", transformers.LlamaConfig,
                           transformers.LlamaForCausalLM, False)
  pzp.export_hf(pzp.pretrained.load_hf(tmp_path / "src"), tmp_path / "out",
                like=tmp_path / "src")
  assert json.loads((tmp_path / "out" / "config.json").read_text())[
      "tie_word_embeddings"] is False
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  np.testing.assert_array_equal(checks.reference_logits(again), checks.reference_logits(theirs))


def test_gemma_refuses_a_stored_head(tmp_path):
  """Penzai's Gemma ties: a stored head (which transformers 5 would use if
  it differs) is refused, naming it, rather than silently dropped."""
  _tied_with_head(tmp_path, transformers.GemmaConfig, transformers.GemmaForCausalLM, False,
                  head_dim=8)
  with pytest.raises(errors.UnsupportedConfigError, match="lm_head.weight"):
    pzp.pretrained.load_hf(tmp_path)
