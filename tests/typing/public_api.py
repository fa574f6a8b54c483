"""Static checks of the public API's types, run by ``mypy`` (CI), never by pytest.

Each ``assert_type`` fails type checking if a signature loses precision:
`load_model` and `load_into` return the model (of the type given to
`load_into`) or ``(model, report)`` by ``strict``; never ``Any``.
"""

from __future__ import annotations

from typing import assert_type

from penzai import pz

import pz_persist as pzp


class Model:
  """Stands for a model class: Penzai ships no type information (to mypy its
  classes are ``Any``), so a class of this file shows what is kept."""


def check(path: str, model: Model, flag: bool) -> None:
  assert_type(pzp.load_model(path), pz.Struct)
  assert_type(pzp.load_model(path, strict=False), tuple[pz.Struct, pzp.LoadReport])
  assert_type(pzp.load_into(path, model), Model)
  assert_type(pzp.load_into(path, model, strict=False), tuple[Model, pzp.LoadReport])
  assert_type(
      pzp.load_into(path, model, strict=flag),
      Model | tuple[Model, pzp.LoadReport],
  )
  # The older spelling keeps the model's type too.
  assert_type(pzp.load_model(path, into=model), Model)
  assert_type(
      pzp.load_model(path, into=model, strict=False), tuple[Model, pzp.LoadReport]
  )
  # Binding options as one value, as keywords, or both; migrate keeps the type too.
  options = pzp.BindOptions(only="mlp/*", dtype="bfloat16")
  assert_type(pzp.load_into(path, model, options), Model)
  assert_type(
      pzp.load_into(path, model, options, strict=False, overlay=True),
      tuple[Model, pzp.LoadReport],
  )
  assert_type(options.with_keywords(rename={"^a/": "b/"}), pzp.BindOptions)
  assert_type(pzp.migrate(path, path + "_native", model, options), Model)


def refused(path: str, model: Model) -> None:
  """What the type checker refuses: a keyword that is no binding option, or
  one of the wrong type (each line fails type checking without its ignore)."""
  pzp.load_into(path, model, renmae={"a": "b"})  # type: ignore[call-overload]
  pzp.load_into(path, model, overlay="yes")  # type: ignore[call-overload]
