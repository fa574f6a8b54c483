"""The diff's HTML as a person sees it, in headless Chromium.

Why: HTML that contains the right words can still show the wrong thing: a
highlight that is not drawn, a folded block that does not open, a script
error that leaves "(Loading...)". So the page `CheckpointDiff.save_html`
writes for a real edit (a LoRA adapter inserted, a weight edited) is opened
in Debian's ``chromium`` over the DevTools protocol (`docs_browser`), and
checked where it is drawn: the changed array's statistics are visible in the
highlight colour, an unchanged block starts folded and opens on a click,
the adapter is marked added in colour and in words, and nothing is logged
as an error.
"""

from __future__ import annotations

import dataclasses
import pathlib

import docs_browser
import jax
import model_zoo
import pytest
from penzai import pz
from penzai.toolshed import lora

import pz_persist as pzp
from pz_persist.tools import diff_view


@pytest.fixture(scope="module")
def browser():
  executable = docs_browser.chromium_path()
  if not executable:
    pytest.skip("headless Chromium is absent (apt-get install -y chromium; CI installs it)")
  opened = docs_browser.Browser(executable)
  yield opened
  opened.close()


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
  model = model_zoo.mlp()
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(pz.nn.Linear).pick_nth_selected(1),
      rank=2, init_base_rng=jax.random.key(1))

  def edit(p):
    if p.label == "mlp/Affine_0/AddBias.bias":
      return dataclasses.replace(p, value=p.value + 0.5)
    return p

  unbound, params = pz.unbind_params(adapted, freeze=True)
  edited = pz.bind_variables(unbound, [edit(p) for p in params], unfreeze_as_copy=True)
  out = tmp_path_factory.mktemp("diff") / "diff.html"
  pzp.diff(model, edited, progress=False).save_html(out)
  return pathlib.Path(out).as_uri()


ROOT = "document.querySelector('treescope-container').shadowRoot"

SPANS_WITH = """((text) => [...ROOT.querySelectorAll('span')]
  .filter(s => s.children.length === 0 && s.textContent.startsWith(text)))""".replace("ROOT", ROOT)


def _rgb(css: str) -> str:
  """``background-color: #ffe08a; ...`` as the browser computes it."""
  colour = css.split("background-color:")[1].split(";")[0].strip().lstrip("#")
  r, g, b = (int(colour[i:i + 2], 16) for i in (0, 2, 4))
  return f"rgb({r}, {g}, {b})"


def _open(browser, page):
  browser.open(page)
  browser.wait_for(f"document.querySelector('treescope-container') && {ROOT}"
                   " && {ROOT}.querySelector('.treescope_root') !== null".replace(
                       "{ROOT}", ROOT), "the diff to render")


def test_changed_array_is_highlighted_with_its_statistics(browser, page):
  _open(browser, page)
  found = browser.evaluate(f"""{SPANS_WITH}('changed: max |A-B|').map(s => ({{
      text: s.textContent, background: getComputedStyle(s).backgroundColor,
      visible: s.getClientRects().length > 0}}))""")
  assert len(found) == 1, found
  assert found[0]["visible"] and found[0]["background"] == _rgb(diff_view.ARRAY_HIGHLIGHT)
  assert "max |A-B| 0.5" in found[0]["text"] and "100% of elements changed" in found[0]["text"]
  assert browser.errors() == []


def test_added_adapter_is_marked_in_colour_and_words(browser, page):
  _open(browser, page)
  found = browser.evaluate(f"""{SPANS_WITH}('added').map(s => ({{
      next: s.parentElement.textContent,
      background: getComputedStyle(s).backgroundColor,
      visible: s.getClientRects().length > 0}}))""")
  adapter = [f for f in found if "LowRankAdapter" in f["next"] and f["visible"]]
  assert adapter, found
  assert adapter[0]["background"] == _rgb(diff_view.STYLES["added"])
  assert browser.errors() == []


FOLDED_UNCHANGED = """(() => {
  const root = ROOT;
  const toggles = [...root.querySelectorAll('.foldable_node_toggle')].filter(t => !t.checked);
  for (const toggle of toggles) {
    const node = toggle.parentElement;
    if (!node.textContent.includes('unchanged')) continue;
    node.scrollIntoView({block: 'center'});
    const box = node.getBoundingClientRect();
    window.__pzToggle = toggle;
    window.__pzText = root.querySelector('.treescope_root').innerText;
    return {x: box.left + 2, y: box.top + 8};
  }
  return null;
})()""".replace("ROOT", ROOT)


def test_folded_unchanged_block_expands_on_click(browser, page):
  _open(browser, page)
  before = browser.evaluate(f"{ROOT}.querySelector('.treescope_root').innerText")
  assert "mlp/Affine_0/Linear.weights" not in before  # Folded: inside an unchanged block.
  target = browser.evaluate(FOLDED_UNCHANGED)
  assert target, "no folded unchanged block"
  browser.click(target)  # A person's click.
  assert browser.wait_for("window.__pzToggle.checked", "the block to expand")
  after = browser.evaluate(f"{ROOT}.querySelector('.treescope_root').innerText")
  assert len(after) > len(before)
  assert "Linear.weights" in after
  assert browser.errors() == []
