"""The notebooks are documentation that must run: execute them, check outputs."""

from __future__ import annotations

import os

import nbclient
import nbformat
from conftest import REPO

NOTEBOOKS = os.path.join(REPO, "notebooks")


def _execute(name: str, tmp_path) -> nbformat.NotebookNode:
  notebook = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  client = nbclient.NotebookClient(
      notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  )
  # The kernel inherits the environment: keep its temporary files in tmp_path.
  previous = os.environ.get("TMPDIR")
  os.environ["TMPDIR"] = str(tmp_path)
  try:
    client.execute()
  finally:
    if previous is None:
      del os.environ["TMPDIR"]
    else:
      os.environ["TMPDIR"] = previous
  return notebook


def _outputs(notebook: nbformat.NotebookNode) -> str:
  """Everything the cells showed. Stream text is joined as written: the
  kernel may flush one ``print`` in several chunks."""
  texts = []
  for cell in notebook.cells:
    for output in cell.get("outputs", []):
      if "text" in output:
        texts.append(output["text"])
      for mime in ("text/plain", "text/html"):
        if mime in output.get("data", {}):
          texts.append(f"\n{output['data'][mime]}\n")
  return "".join(texts)


def test_quickstart(tmp_path):
  text = _outputs(_execute("quickstart.ipynb", tmp_path))
  assert "outputs identical: True" in text
  assert "ParameterValue transformer/blocks/attention/query.weights" in text
  assert "'query_heads': 2" in text
  assert "manager restore: ParameterValue transformer/embedder.embeddings" in text
  assert "treescope" in text.lower()  # Rich treescope renderings were produced.


def test_model_surgery(tmp_path):
  text = _outputs(_execute("model_surgery.ipynb", tmp_path))
  assert "LoRA parameters added" in text
  assert "label" in text and "LoRA_A.weights" in text  # The inspect table.
  assert "fresh kernel: ok" in text
  assert "fresh-kernel outputs match the edited model: True" in text
  assert "and differ from the base model: True" in text
  assert "renderings identical: True" in text
  assert "adapter overlay matches: True" in text
  # pzp.diff after each edit: the adapters added, the block cut, the weights
  # edited with their statistics, and no difference from the saved model.
  assert "8 LowRankAdapter(s) added, each wrapping its Linear; base weights unchanged: True" in text
  assert "removed  tree.body.sublayers[1]  TransformerBlock" in text
  assert "query.weights: max |A-B| 0.153, |A-B|/|B| 0.333, 100% of elements changed" in text
  assert "no differences: TransformerLM in memory and" in text and "identical: True" in text


def test_training_resume(tmp_path):
  notebook = _execute("training_resume.ipynb", tmp_path)
  text = _outputs(notebook)
  assert "saved steps: [15, 17]" in text
  assert "resuming at step 17 with schedule count 17" in text
  assert "curves identical: True" in text
  images = [
      output for cell in notebook.cells for output in cell.get("outputs", [])
      if "image/png" in output.get("data", {})
  ]
  assert len(images) == 1  # The plot of both curves.


def test_sharded_loading(tmp_path):
  text = _outputs(_execute("sharded_loading.ipynb", tmp_path))
  assert "8 devices" in text
  assert "gemma/block_0/mlp/gating_linear.weights" in text
  assert "P('data', 'model')" in text  # (embedding, neurons)
  assert "outputs match: True" in text
  assert "axis 'head_groups' has size 2, which mesh axes ('model',) (4 devices) do not divide" in text


def test_committed_notebooks_carry_their_outputs():
  """Users browse the notebooks on GitHub: they must be saved executed
  (``python notebooks/execute.py``), with treescope renderings, and small."""
  for name in sorted(os.listdir(NOTEBOOKS)):
    if not name.endswith(".ipynb"):
      continue
    path = os.path.join(NOTEBOOKS, name)
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.get("execution_count") for cell in code), f"{name} is not executed"
    assert "treescope" in _outputs(notebook).lower() or name == "training_resume.ipynb", name
    assert os.path.getsize(path) < 2 * 2**20, f"{name} is over 2 MiB"


def test_notebook_layers(tmp_path):
  text = _outputs(_execute("notebook_layers.ipynb", tmp_path))
  assert "module of MyScale: __main__" in text
  assert "written: False" in text and "saved; written: True" in text
  assert "MyScale defined there: False" in text
  assert ("tree.sublayers[0]: __main__.MyScale is not defined in this process: run the cell that"
          " defines it, or move it into a module") in text
  assert "MyScale defined in __main__" in text
  assert "outputs in the second kernel match this one's: True" in text
  assert "renderings identical: True" in text
