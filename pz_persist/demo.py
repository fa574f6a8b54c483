"""The README's first command: save a small Penzai model and load it back.

Run ``python -m pz_persist.demo [--out DIR]``. It builds a small llamalike
transformer, saves it whole with `pz_persist.save_model`, prints the
checkpoint's table of arrays, loads it back with `pz_persist.load_model` (no
template, no model code), prints the restored model, checks that its outputs
are bit-identical, writes a treescope HTML view of it you can open in a
browser, and says what to try next (`next_steps`).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from penzai.models.transformer.variants import llamalike_common

import pz_persist as pzp
from pz_persist.storage import destinations
from pz_persist.tools import viewing


def build_model() -> pz.nn.Layer:
  """A small llamalike transformer (about 100k parameters)."""
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2,
      query_head_multiplier=2,
      embedding_dim=64,
      projection_dim=16,
      mlp_hidden_dim=128,
      num_decoder_blocks=2,
      vocab_size=256,
      mlp_variant="swiglu",
      tie_embedder_and_logits=False,
      use_layer_stack=True,
  )
  return llamalike_common.build_llamalike_transformer(
      config, init_base_rng=jax.random.key(0), name="transformer"
  )


NEXT_IN_THE_REPOSITORY = (
    ("notebooks/quickstart.ipynb", "save, inspect and load, open lazily, in treescope"),
    ("notebooks/model_surgery.ipynb", "edit a model, save it whole, reload it, diff it"),
    ("notebooks/training_resume.ipynb", "stop and resume training exactly"),
    ("notebooks/sharded_loading.ipynb", "load onto a device mesh by axis names"),
    ("notebooks/notebook_layers.ipynb", "save layers defined in a notebook, load them again"),
    ("docs/guides/quickstart.md", "the guides begin here (all of them: docs/index.md)"),
)
"""What to read after the demo, by path in the repository (the README lists
the same): the notebooks render in Jupyter, on GitHub and on the docs site."""


def next_steps(checkpoint: pathlib.Path) -> str:
  """What to try after the demo: commands on the checkpoint it saved, which
  work wherever pz_persist is installed, then the notebooks and guides."""
  try:
    where = str(checkpoint.relative_to(pathlib.Path.cwd()))
  except ValueError:
    where = str(checkpoint)
  quoted = shlex.quote(where)
  commands = (
      (f"pz-persist inspect {quoted}", "its table again, from the shell; no array read"),
      (f"pz-persist verify {quoted}", "every file and array against its checksum"),
  )
  width = max(len(text) for text, _ in commands + NEXT_IN_THE_REPOSITORY)
  lines = ["What to try next:"]
  lines += [f"  {text:<{width}}  {what}" for text, what in commands]
  lines.append("In the repository (a clone, or its page on GitHub):")
  lines += [f"  {text:<{width}}  {what}" for text, what in NEXT_IN_THE_REPOSITORY]
  return "\n".join(lines)


def _outline(layer: Any, where: str = "model", depth: int = 0) -> list[str]:
  """The restored model's layers, a line each, three levels deep: a terminal
  shows this, where treescope's text rendering puts each layer on one line of
  thousands of characters (the HTML view written below shows everything)."""
  lines = [f"{'  ' * depth}{where}: {type(layer).__name__}"]
  if depth == 3 or not dataclasses.is_dataclass(layer):
    return lines
  for field in dataclasses.fields(layer):
    value = getattr(layer, field.name)
    items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
    for index, child in items:
      if isinstance(child, pz.nn.Layer):
        name = field.name if index is None else f"{field.name}[{index}]"
        lines += _outline(child, name, depth + 1)
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--out", default="pz_persist_demo", help="directory for the checkpoint and HTML"
  )
  args = parser.parse_args(argv)
  out = pathlib.Path(destinations.check_output(args.out)).resolve()  # file:// too.
  checkpoint = out / "checkpoint"
  for written in (checkpoint, out / "restored.html"):  # The destination rule
    destinations.check_output(written)  # (never inside a checkpoint), first.

  model = build_model()
  _, params = pz.unbind_params(model, freeze=True)
  count = sum(int(np.prod(p.value.data_array.shape)) for p in params)
  print(f"Built a llamalike transformer with {len(params)} parameters ({count:,} values).")

  pzp.save_model(checkpoint, model, overwrite=True)
  print(f"Saved it, structure and variables, to {checkpoint}:\n")
  print(viewing.describe_checkpoint(checkpoint))

  restored = pzp.load_model(checkpoint)  # No template, no model code needed.
  print("\nLoaded it back with pz_persist.load_model(path), no model code needed:\n")
  print("\n".join(_outline(restored)))

  tokens = pz.nx.wrap(jnp.arange(16).reshape(2, 8), "batch", "seq")
  identical = (
      np.asarray(restored(tokens).data_array).tobytes()
      == np.asarray(model(tokens).data_array).tobytes()
  )
  print(f"\nThe restored model's outputs are bit-identical to the original's: {identical}")

  html = pzp.render_html(restored, out / "restored.html")
  print(f"Treescope view of the restored model: {html}")
  print(f"\n{next_steps(checkpoint)}")
  return 0 if identical else 1


if __name__ == "__main__":
  sys.exit(main())
