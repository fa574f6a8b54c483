"""Every family under the one rule on stored tensors
(`pz_persist.pretrained.hf.unread`): what transformers' own model of each
text ``model_type`` saves passes it, and a tensor added to that save which
the model does not read is refused, named, before any tensor is read.

The folders are transformers' ``save_pretrained`` of each family's tiny
model from sizes alone (test_hf_defaults' ``MINIMAL``); the added tensors are
derived from what the family stores (a bias beside a weight stored without
one, a misspelled name, a name of no module), so each family is attacked
where its own names are.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
import transformers

from pretrained import hf_family_harness as checks
from pretrained.test_hf_defaults import MINIMAL
from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf import load as hf_load


@pytest.fixture
def no_reads(monkeypatch):
  """Any tensor read raises `_Read`: reaching one means every check, the
  unread-tensor rule included, has passed."""
  def refuse(self, name, *args, **kwargs):
    raise _Read(name)
  for method in ("get", "read_into", "read_stack_into"):
    monkeypatch.setattr(safetensors_io.SafetensorsFile, method, refuse)


class _Read(Exception):
  """A tensor was read: the load got past its checks."""


def _added(stored: dict[str, np.ndarray]) -> dict[str, str]:
  """The tensors added to a family's save, by the class of case."""
  weights = sorted(name for name in stored if name.endswith(".weight")
                   and name.removesuffix(".weight") + ".bias" not in stored)
  first = weights[0]
  return {"bias": first.removesuffix(".weight") + ".bias", "misspelled": first + "s",
          "unknown": "unknown_module.weight"}


@pytest.mark.parametrize("model_type", sorted(MINIMAL))
def test_every_family_refuses_what_its_model_does_not_read(tmp_path, model_type, no_reads):
  fields = dict(MINIMAL[model_type])
  model = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(model_type, **fields))
  saved = tmp_path / "saved"
  model.save_pretrained(saved, safe_serialization=True)
  (saved / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
  # transformers' own save passes the rule (the load reaches its first read).
  with pytest.raises(_Read):
    hf_load.load_hf(saved)
  stored = checks.tensors(saved)
  for case, name in _added(stored).items():
    folder = tmp_path / case
    folder.mkdir()
    (folder / "config.json").write_text((saved / "config.json").read_text())
    safetensors.numpy.save_file({**stored, name: np.zeros((2,), np.float32)},
                                str(folder / "model.safetensors"))
    with pytest.raises(errors.UnreadTensorsError, match="1 stored tensor is read") as info:
      hf_load.load_hf(folder)
    assert repr(name) in str(info.value) and str(folder) in str(info.value), (model_type, case)
