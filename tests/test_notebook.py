"""examples/explore.ipynb runs top to bottom on CPU (so it never rots)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).parents[1] / "examples" / "explore.ipynb"


def test_explore_notebook_executes(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2
    assert any("TCPETCalculator" in o.get("data", {}).get("text/html", "") for o in outputs)
    text = "".join(o.get("text", "") for o in outputs)
    assert "tf32x3" in text and "max dF" in text
