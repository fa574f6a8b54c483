"""The ``config.json`` fields each record declares its plan leaves unread
(`pz_persist.pretrained.hf.record.ModelType.ignored_fields`): each is a field
of transformers' config class for that ``model_type`` or declared foreign (and
then absent from it), and `Config.check_all_used`, the one place unread
fields are refused, accepts exactly those (still checking their values)."""

from __future__ import annotations

import inspect

import pytest
import transformers

from pz_persist import errors
from pz_persist.pretrained.hf import families
from pz_persist.pretrained.hf import multimodal
from pz_persist.pretrained.hf.config import ANY
from pz_persist.pretrained.hf.config import IGNORED_FIELDS
from pz_persist.pretrained.hf.config import Config

_DECLARING = sorted(name for name, t in families.MODEL_TYPES.items() if t.ignored_fields)


def _class_fields(model_type: str) -> set[str]:
  """The fields of transformers' config class for ``model_type``: what an
  instance built without arguments holds, and its constructor's arguments."""
  cls = transformers.CONFIG_MAPPING[model_type]
  instance = cls()
  return {*instance.to_dict(), *vars(instance),
          *inspect.signature(cls.__init__).parameters} - {"self", "kwargs"}


def test_records_declare_ignored_fields():
  """The declared fields replace bare reads: the families that leave fields
  unread say so (a multimodal folder's towers, training-only settings)."""
  assert {"gemma3", "llama4", "gemma4", "qwen3_5", "mixtral", "phi3"} <= set(_DECLARING)


@pytest.mark.parametrize("model_type", _DECLARING)
def test_each_ignored_field_is_one_of_transformers_fields(model_type):
  declared = families.MODEL_TYPES[model_type]
  theirs = _class_fields(model_type)
  for why, fields in declared.ignored_fields.items():
    assert why and fields, f"{model_type}: an empty group or reason"
  not_ignored = declared.foreign_fields - declared.ignored
  assert not not_ignored, f"{model_type}: foreign_fields not ignored: {sorted(not_ignored)}"
  unknown = declared.ignored - declared.foreign_fields - theirs
  assert not unknown, (f"{model_type}: {sorted(unknown)} are not fields of"
                       f" {transformers.CONFIG_MAPPING[model_type].__name__};"
                       " declare them in foreign_fields if only the Hub's configs hold them")
  now_theirs = declared.foreign_fields & theirs
  assert not now_theirs, (f"{model_type}: {sorted(now_theirs)} are now transformers' own:"
                          " drop them from foreign_fields")


@pytest.mark.parametrize("model_type", _DECLARING)
def test_check_all_used_accepts_the_declared_and_refuses_the_rest(model_type):
  """Each declared field, unread, passes; the same config without the
  declarations is refused, naming the field (unless every family may leave
  it unread: `IGNORED_FIELDS`)."""
  declared = families.MODEL_TYPES[model_type]
  schema = families.FAMILY_OF[model_type].fields
  for field in sorted(declared.ignored):
    valid = Config({}, "config.json", schema).schema.get(field, ANY)[0]
    raw = {field: next(v for v in (1, True, "x", [], [0, 0, 0], 0.5, {}) if valid(v))}
    Config(raw, "config.json", schema, ignored=declared.ignored).check_all_used()
    if field not in IGNORED_FIELDS:
      with pytest.raises(errors.UnsupportedConfigError, match=field):
        Config(raw, "config.json", schema).check_all_used()


def test_an_ignored_field_is_still_checked():
  """Declaring a field ignored does not let a damaged value through: it is
  checked against the schema as a read would have."""
  declared = families.MODEL_TYPES["gemma3"]
  cfg = Config({"vision_config": 5}, "config.json", families.FAMILY_OF["gemma3"].fields,
               ignored=declared.ignored)
  with pytest.raises(errors.UnsupportedConfigError, match="vision_config must be"):
    cfg.check_all_used()


@pytest.mark.parametrize("folder_type", sorted(
    name for name, t in families.MODEL_TYPES.items() if t.written_as and t.ignored))
def test_a_folder_field_inside_text_config_is_refused(folder_type):
  """What a multimodal folder's own config may leave unread (its towers'
  fields) is not thereby accepted inside its ``text_config``: each
  ``model_type`` declares its own."""
  text_type = families.MODEL_TYPES[folder_type].written_as
  outer = Config({}, "config.json", families.FAMILY_OF[folder_type].fields,
                 families.DEFAULTS[folder_type], families.MODEL_TYPES[folder_type].ignored)
  for field in sorted(families.MODEL_TYPES[folder_type].ignored
                      - families.MODEL_TYPES[text_type].ignored - IGNORED_FIELDS):
    valid = outer.schema.get(field, ANY)[0]
    value = next(v for v in (1, True, "x", [], 0.5, {}) if valid(v))
    text = multimodal.text_config(outer, {field: value}, folder_type, text_type,
                                  families.FAMILY_OF[folder_type].fields,
                                  families.MODEL_TYPES[text_type].ignored)
    with pytest.raises(errors.UnsupportedConfigError, match=field):
      text.check_all_used()
