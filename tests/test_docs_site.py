"""The documentation site, built as CI builds it and looked at in a browser.

Why: a site that builds can still be broken where a person looks: a
notebook's treescope output stuck at "(Loading...)", a script error, an API
page without the function, a link to a section that was renamed. So the site
is built with warnings as errors (as ``.ci/run`` does; ``PZ_PERSIST_DOCS_HTML``
names an already built copy to look at instead), served on 127.0.0.1, and
opened in headless Chromium (Debian's ``chromium``, driven over the DevTools
protocol by `docs_browser`): the quick start, a notebook whose treescope
rendering is expanded by a click, and the API page of ``load_model``, each
without console errors. Every internal link and anchor of every page is
checked too.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import subprocess
import sys
import threading
import urllib.parse

import docs_browser
import pytest
from conftest import REPO

import pz_persist


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
  """The built site's directory: ``PZ_PERSIST_DOCS_HTML``, or built here."""
  built = os.environ.get("PZ_PERSIST_DOCS_HTML")
  if built:
    assert os.path.isfile(os.path.join(built, "index.html")), built
    return built
  out = str(tmp_path_factory.mktemp("docs") / "html")
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       os.path.join(REPO, "docs"), out,
       "-d", str(tmp_path_factory.mktemp("doctrees"))],
      capture_output=True, text=True, timeout=900, cwd=REPO,
  )
  assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
  return out


@pytest.fixture(scope="module")
def server(site):
  """The site served over HTTP on 127.0.0.1 (scripts and fetches behave as
  on a real host, which file:// URLs do not)."""
  handler = functools.partial(_QuietHandler, directory=site)
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{httpd.server_address[1]}"
  httpd.shutdown()
  httpd.server_close()
  thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, format, *args):  # noqa: A002 (the base class's name)
    pass


@pytest.fixture(scope="module")
def browser():
  executable = docs_browser.chromium_path()
  assert executable, (
      "headless Chromium is needed to look at the site: apt-get install -y chromium"
      " (.ci/run installs it)"
  )
  opened = docs_browser.Browser(executable)
  yield opened
  opened.close()


def _look(browser, url: str) -> None:
  """Opens ``url`` and keeps a screenshot when ``PZ_PERSIST_DOCS_SCREENSHOTS``
  names a folder (CI artifacts)."""
  browser.open(url)
  folder = os.environ.get("PZ_PERSIST_DOCS_SCREENSHOTS")
  if folder:
    os.makedirs(folder, exist_ok=True)
    name = urllib.parse.urlparse(url).path.strip("/").replace("/", "_") or "index"
    browser.screenshot(os.path.join(folder, name + ".png"))


def test_quick_start_page(server, browser):
  _look(browser, f"{server}/guides/quickstart.html")
  assert browser.evaluate("document.querySelector('h1').textContent").startswith("Quick start")
  code = browser.evaluate(
      "[...document.querySelectorAll('div.highlight pre')].map(p => p.textContent).join('\\n')")
  assert "pzp.save(" in code and "pzp.load(" in code and "pip install" in code
  # The page links on to the notebook, rendered on the site.
  assert browser.evaluate(
      "[...document.querySelectorAll('a')].some(a => a.href.endsWith('notebooks/quickstart.html'))")
  assert browser.errors() == []


EXPAND_FIRST_FOLDED = """(() => {
  for (const container of document.querySelectorAll('treescope-container')) {
    const root = container.shadowRoot;
    const folded = [...root.querySelectorAll('.foldable_node_toggle')].find(t => !t.checked);
    if (!folded) continue;
    const label = folded.parentElement;
    label.scrollIntoView({block: 'center'});
    const box = label.getBoundingClientRect();
    window.__pzToggle = folded;
    window.__pzText = root.querySelector('.treescope_root').innerText.length;
    return {x: box.left + 2, y: box.top + box.height / 2};
  }
  return null;
})()"""


def _render_every_treescope_output(browser) -> int:
  """Scrolls to each treescope output (treescope renders one once it nears
  the viewport) and waits until it has rendered; returns how many there are."""
  containers = browser.evaluate("document.querySelectorAll('treescope-container').length")
  for i in range(containers):
    browser.evaluate(f"document.querySelectorAll('treescope-container')[{i}].scrollIntoView()")
    browser.wait_for(
        f"document.querySelectorAll('treescope-container')[{i}].shadowRoot"
        ".querySelector('.treescope_root') !== null", f"treescope output {i} to render")
  return containers


@pytest.mark.parametrize(
    "notebook", ["quickstart", "model_surgery", "sharded_loading", "training_resume"])
def test_every_notebook_page_renders(server, browser, notebook):
  _look(browser, f"{server}/notebooks/{notebook}.html")
  containers = _render_every_treescope_output(browser)
  assert containers >= (0 if notebook == "training_resume" else 1)
  if notebook == "training_resume":  # Its plot, as an image that loaded.
    browser.evaluate(
        "[...document.images].find(i => i.src.includes('_images/')).scrollIntoView()")
    browser.wait_for(
        "[...document.images].some(i => i.src.includes('_images/') && i.naturalWidth > 0)",
        "the notebook's plot to load")
  assert browser.errors() == []


def test_notebook_treescope_rendering_expands_on_click(server, browser):
  _look(browser, f"{server}/notebooks/quickstart.html")
  assert _render_every_treescope_output(browser) >= 3
  target = browser.evaluate(EXPAND_FIRST_FOLDED)
  assert target, "no folded treescope node to expand on the quick start notebook"
  browser.click(target)  # A person's click.
  assert browser.wait_for("window.__pzToggle.checked", "the node to expand")
  grown = browser.evaluate(
      "window.__pzToggle.getRootNode().querySelector('.treescope_root').innerText.length")
  assert grown > browser.evaluate("window.__pzText"), "expanding showed nothing more"
  assert browser.errors() == []


def test_load_model_api_page(server, browser):
  _look(browser, f"{server}/reference/api.html#pz_persist.load_model")
  text = browser.evaluate(
      "document.getElementById('pz_persist.load_model').parentElement.innerText")
  assert "load_model(" in text and "into" in text and "Example" in text
  examples = browser.evaluate(
      "[...document.querySelectorAll('div.highlight pre')].map(p => p.textContent).join('\\n')")
  assert "pzp.load_model(" in examples
  assert browser.errors() == []


def _ids(html_text: str) -> set[str]:
  collector = _Collector()
  collector.feed(html_text)
  return collector.ids


class _Collector(html.parser.HTMLParser):
  def __init__(self):
    super().__init__()
    self.ids: set[str] = set()
    self.links: list[str] = []

  def handle_starttag(self, tag, attrs):
    attributes = dict(attrs)
    if attributes.get("id"):
      self.ids.add(attributes["id"])
    if tag == "a" and attributes.get("href"):
      self.links.append(attributes["href"])


def test_every_internal_link_resolves(site):
  """Every link between pages (and to an anchor) of the built site lands."""
  pages: dict[str, _Collector] = {}
  for folder, _, files in os.walk(site):
    for name in files:
      if name.endswith(".html"):
        path = os.path.join(folder, name)
        collector = _Collector()
        with open(path, encoding="utf-8") as f:
          collector.feed(f.read())
        pages[os.path.normpath(path)] = collector
  broken = []
  for path, collector in pages.items():
    for href in collector.links:
      parsed = urllib.parse.urlparse(href)
      if parsed.scheme or parsed.netloc or href.startswith("mailto:"):
        continue
      target = os.path.normpath(os.path.join(os.path.dirname(path), parsed.path)) \
          if parsed.path else path
      if os.path.isdir(target):
        target = os.path.join(target, "index.html")
      if not os.path.exists(target):
        broken.append(f"{os.path.relpath(path, site)}: {href} (no such file)")
      elif parsed.fragment and target in pages and \
          urllib.parse.unquote(parsed.fragment) not in pages[target].ids:
        broken.append(f"{os.path.relpath(path, site)}: {href} (no such anchor)")
  assert len(pages) >= 20
  assert broken == [], "\n".join(broken)


def test_api_reference_documents_every_public_name(site):
  with open(os.path.join(site, "reference", "api.html"), encoding="utf-8") as f:
    ids = _ids(f.read())
  missing = [
      name for name in pz_persist.__all__
      if f"pz_persist.{name}" not in ids and f"module-pz_persist.{name}" not in ids
  ]
  assert missing == []


def test_every_public_name_has_an_example():
  """The API page's section of each public name holds a Python example (which
  `tests/test_readme.py` runs with the page's other snippets)."""
  with open(os.path.join(REPO, "docs", "reference", "api.md"), encoding="utf-8") as f:
    sections = f.read().split("\n### ")[1:]
  examples = {s.split("`")[1]: "```python\n" in s for s in sections}
  assert set(examples) == set(pz_persist.__all__)
  assert [name for name, has in examples.items() if not has] == []


def test_cli_reference_has_every_command(site):
  from pz_persist.tools import cli

  with open(os.path.join(site, "reference", "cli.html"), encoding="utf-8") as f:
    page = f.read()
  commands = cli.build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
  assert set(commands) >= {"inspect", "diff", "verify", "ls", "clean", "convert", "migrate"}
  for name, parser in commands.items():
    assert f'id="pz-persist-{name}"' in page, name
    assert html_escape(parser.format_usage().split()[1]) in page


def html_escape(text: str) -> str:
  import html as html_lib

  return html_lib.escape(text, quote=False)
