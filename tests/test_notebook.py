"""The quickstart notebook runs top to bottom, so it never rots, and shows its plot inline."""

from __future__ import annotations

import base64
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quickstart_notebook_executes_and_shows_its_plot(smollm2_dir, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # a non-inline default: the notebook must select inline itself
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    printed = "".join(o.get("text", "") for o in outputs)
    assert "acceptance length" in printed
    assert "tokens" in printed
    # The plot cell's figure is in the executed notebook, as a PNG image.
    plot_cell = nb.cells[-1]
    assert "ax.bar" in plot_cell.source
    images = [o["data"]["image/png"] for o in plot_cell.outputs
              if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})]
    assert len(images) == 1, [o.get("output_type") for o in plot_cell.outputs]
    png = base64.b64decode(images[0])
    assert png.startswith(PNG_MAGIC) and len(png) > 5_000  # a drawn figure, not an empty canvas
