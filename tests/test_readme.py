"""Every Python snippet of the README and of the documentation site's pages
runs, in order, as a user would paste it.

Why: the README is the first code a user runs, and snippets rot silently (three
training snippets once shared one run directory and failed when run in order).
Each ```python block runs in one fresh interpreter, one after another, sharing a
namespace as a notebook would. A block may be preceded by an HTML comment
``<!-- readme-test: setup NAME -->`` (invisible on GitHub): the placeholder
definitions of `SETUP` [NAME] then run first, standing in for what the reader
already has (a model, a training step, a downloaded folder). Absolute paths
``/tmp/...`` and ``/ckpt/...`` are moved into the test's temporary directory;
downloads are replaced by tiny local folders in the published formats.

The README is the front page; the guides hold what it used to (each one's
snippets run after the README's, in `PAGES` order, which is the order the
README had them in, so later snippets may use what earlier ones built), then
the API reference's examples, one per public name.
"""

from __future__ import annotations

import os
import re
import textwrap

from conftest import REPO
from conftest import run_python

BLOCK = re.compile(
    r"(?:<!-- readme-test: setup (?P<setup>[\w-]+) -->\s*\n)?```python\n(?P<code>.*?)```",
    re.S,
)

PREAMBLE = """
import sys, types, os
sys.path.insert(0, {tests!r})
sys.path.insert(0, {pretrained_tests!r})
ROOT = {root!r}
"""

SETUP = {
    "overlay": """
        import jax
        from penzai import pz
        from penzai.models import simple_mlp
        from penzai.toolshed import lora
        import pz_persist as pzp
        base = simple_mlp.MLP.from_config(
            name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[8, 32, 8])
        pzp.save_model("/tmp/base", base, overwrite=True)
        lora_model = lora.loraify_linears_in_selection(
            pz.select(base).at_instances_of(pz.nn.Linear), rank=2,
            init_base_rng=jax.random.key(1))
        _adapter = [v for v in pz.unbind_params(lora_model, freeze=True)[1]
                    if "lora" in str(v.label).lower()]
        pzp.save("/tmp/adapter", _adapter, overwrite=True)
    """,
    "plain-orbax": """
        def build_my_model():
            return simple_mlp.MLP.from_config(
                name="mlp", init_base_rng=jax.random.key(3), feature_sizes=[8, 32, 8])
        model = build_my_model()
    """,
    "sharding": """
        import model_zoo
        pzp.save_model("/tmp/gemma_tiny", model_zoo.gemma_style_transformer(), overwrite=True)
        pzp.save("/tmp/params", pz.unbind_params(base, freeze=True)[1], overwrite=True)
        manager = pzp.CheckpointManager("/tmp/sharding_run")
        manager.save(1, params=pz.unbind_params(base, freeze=True)[1])
        manager.wait_until_finished()
        fresh_model = simple_mlp.MLP.from_config(
            name="mlp", init_base_rng=jax.random.key(5), feature_sizes=[8, 32, 8])
    """,
    "optax-loop": """
        import jax.numpy as jnp
        import optax
        num_steps = 3
        def batch(step):
            x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8) * (step + 1)
            return {"x": pz.nx.wrap(x, "batch", "features"),
                    "y": pz.nx.wrap(jnp.ones((2, 8)), "batch", "features")}
        def _loss(model, x, y):
            return jnp.mean(((model(x) - y) ** 2).unwrap("batch", "features"))
        def train_step(params, opt_state, rng, batch):
            rng, _ = jax.random.split(rng)
            loss, grads = jax.value_and_grad(
                lambda p: _loss(pz.bind_variables(unbound, p), **batch))(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, rng, loss
    """,
    "trainer": """
        def loss_fn(*, model, state, rng, x, y):
            return _loss(model, x, y), state, {}
    """,
    "gemma-download": """
        import test_gemma
        # Gemma 2 2B's head layout (4 key/value head groups) at a tiny size.
        _TINY = dict(test_gemma.GEMMA2, num_kv_heads=4)
        def _model_download(handle):
            folder = os.path.join(ROOT, "kaggle", "gemma2-2b")
            if not os.path.exists(folder):
                test_gemma.write(folder, test_gemma.official_params(_TINY, gemma2=True))
            return os.path.dirname(folder)
        sys.modules["kagglehub"] = types.SimpleNamespace(model_download=_model_download)
        # The download above is tiny: give Penzai a preset of its sizes, as
        # test_gemma does, so preset="auto" finds it as it finds gemma2_2b.
        from penzai.models.transformer.variants import gemma as _pz_gemma
        _pz_gemma._GEMMA_PRESETS["tiny_gemma2"] = dict(
            _pz_gemma._GEMMA_PRESETS["gemma2_2b"], **_TINY)
        _pz_gemma._NEEDS_GATING_TRANSPOSE["tiny_gemma2"] = False
    """,
    "hf-download": """
        # `hf download meta-llama/Llama-3.2-1B --local-dir Llama-3.2-1B`, at a tiny size:
        # the Hub's own config.json (transformers-4 style: tied embeddings, llama3
        # rope_scaling) with only the sizes shrunk, and transformers' safetensors.
        import json, test_rope_scaling, torch, transformers
        if not os.path.exists("Llama-3.2-1B"):
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(transformers.LlamaConfig(
                **test_rope_scaling.LLAMA_3_2_CONFIG)).save_pretrained(
                    "Llama-3.2-1B", safe_serialization=True)
            with open("Llama-3.2-1B/config.json", "w") as f:
                json.dump(test_rope_scaling.LLAMA_3_2_CONFIG, f)
    """,
    "gemma3-download": """
        # `hf download google/gemma-3-1b-it --local-dir gemma-3-1b-it`, at a tiny size:
        # the Hub's own config.json with only the sizes shrunk, transformers' safetensors.
        import test_hf_gemma3
        if not os.path.exists("gemma-3-1b-it"):
            test_hf_gemma3.write_gemma_3_1b_it("gemma-3-1b-it")
    """,
    "converted": """
        from pz_persist.tools import cli
        assert cli.main(["convert", "gemma", os.path.join(ROOT, "kaggle", "gemma2-2b"), "/ckpt/gemma2-2b",
                         "--dtype", "bfloat16", "--quiet"]) == 0
    """,
    "orbax": """
        step = 1
    """,
    "cloud": """
        # The buckets: local emulators (as tests/remote starts them), stopped at exit.
        import atexit, numpy as np
        from remote import emulators
        for _start in (emulators.start_gcs, emulators.start_s3):
            _emulator = _start("my-bucket")
            atexit.register(_emulator.stop)
            emulators.apply_env(_emulator.env)
    """,
}


PAGES = [
    "README.md",
    "docs/guides/quickstart.md",
    "docs/guides/saving-and-loading.md",
    "docs/guides/lazy-open.md",
    "docs/guides/whole-models.md",
    "docs/guides/notebooks.md",
    "docs/guides/from-orbax.md",
    "docs/guides/sharding.md",
    "docs/guides/training.md",
    "docs/guides/cloud-storage.md",
    "docs/guides/pretrained.md",
    "docs/guides/orbax.md",
    "docs/guides/integrity.md",
    "docs/guides/safety.md",
    "docs/guides/performance.md",
    "docs/guides/troubleshooting.md",
    "docs/reference/api.md",
]
"""Every page whose ``python`` snippets run, in the order they run."""


def page_blocks(page: str) -> list[tuple[str | None, str]]:
  with open(os.path.join(REPO, page), encoding="utf-8") as f:
    return [(m["setup"], m["code"]) for m in BLOCK.finditer(f.read())]


def readme_blocks() -> list[tuple[str | None, str]]:
  """The snippets of every page of `PAGES`, in order."""
  return [block for page in PAGES for block in page_blocks(page)]


def test_readme_is_a_front_page():
  """The README stays short (the issue's ~250 lines): the rest lives in docs/."""
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  assert len(lines) <= 250, f"README.md has {len(lines)} lines; move sections into docs/guides"


def test_every_page_with_snippets_is_run():
  """A new guide with Python snippets must be added to `PAGES`."""
  found = set()
  for folder, _, files in os.walk(os.path.join(REPO, "docs")):
    if "_build" in folder:
      continue
    for name in files:
      page = os.path.relpath(os.path.join(folder, name), REPO)
      if name.endswith(".md") and page_blocks(page):
        found.add(page)
  assert found <= set(PAGES), f"pages whose snippets no test runs: {found - set(PAGES)}"


def _relocated(code: str, root: str) -> str:
  return code.replace('"/tmp/', f'"{root}/tmp/').replace('"/ckpt/', f'"{root}/ckpt/')


def test_every_setup_is_used_and_known():
  used = [setup for setup, _ in readme_blocks() if setup]
  assert set(used) <= set(SETUP), set(used) - set(SETUP)
  assert set(SETUP) <= set(used), f"unused setups: {set(SETUP) - set(used)}"


def test_readme_snippets_run_in_order(tmp_path):
  root = str(tmp_path)
  os.makedirs(os.path.join(root, "tmp"))
  os.makedirs(os.path.join(root, "ckpt"))
  tests = os.path.join(REPO, "tests")
  parts = [PREAMBLE.format(tests=tests, pretrained_tests=os.path.join(tests, "pretrained"), root=root),
           f"os.chdir({root!r})"]
  total = 0
  for page in PAGES:
    for number, (setup, code) in enumerate(page_blocks(page)):
      if setup:
        parts.append(_relocated(textwrap.dedent(SETUP[setup]), root))
      parts.append(f"print('{page} block {number}', flush=True)")
      parts.append(_relocated(textwrap.dedent(code), root))
      total += 1
  assert total >= 40
  parts.append("print('README done')")
  out = run_python("\n".join(parts), timeout=900)
  assert "README done" in out
