"""The CPU notebooks execute top to bottom, so they cannot rot."""

import importlib.util
from pathlib import Path

import pytest

# each notebook runs whole in a fresh Jupyter kernel, with its own cluster and model (34 s for the two): in the
# slow leg (.ci/run runs it on every change), beside the README's longest snippet
pytestmark = pytest.mark.slow

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the [test] extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the [test] extra (nbclient)")

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


def _run(name, tiny_model, monkeypatch):
    monkeypatch.setenv("SURGE_NOTEBOOK_MODEL", tiny_model)
    monkeypatch.setenv("SURGE_NOTEBOOK_ROWS", "600")
    monkeypatch.setenv("SURGE_NOTEBOOK_DOCS", "8")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    return nb


def _text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_quickstart_notebook_runs(tiny_model, monkeypatch):
    nb = _run("quickstart.ipynb", tiny_model, monkeypatch)
    assert "and encoded 2" in _text(nb)
    assert "best passage per document for" in _text(nb) and "windows" in _text(nb)
    # progress is a bar updated in place: a widget where ipywidgets is installed, else tqdm's text bar
    shown = [
        o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") in ("display_data", "update_display_data")
    ]
    assert any("application/vnd.jupyter.widget-view+json" in d for d in shown) or (
        "dask-surge [done]" in _text(nb) and "rows" in _text(nb)
    )
    # every plot cell shows its figure inline (no forced backend), and no progress warning leaks out
    plot_cells = [c for c in nb.cells if c.cell_type == "code" and ".plot" in c.source]
    images = [o for c in plot_cells for o in c.outputs if "image/png" in o.get("data", {})]
    assert plot_cells and len(images) >= len(plot_cells), [c.source for c in plot_cells]
    everything = _text(nb) + "".join(
        str(o.get("data", "")) for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    if importlib.util.find_spec("ipywidgets") is not None:  # without it tqdm.auto warns on import in a kernel
        assert "TqdmWarning" not in everything and "IProgress not found" not in everything
    # the search runs over real text (docstring paragraphs of installed packages)
    assert "nearest paragraphs to: how do I read a parquet file" in _text(nb)


def test_rapids_notebook_runs_on_the_cpu_fallback(tiny_model, monkeypatch):
    nb = _run("rapids.ipynb", tiny_model, monkeypatch)
    text = _text(nb)
    try:
        import cudf  # noqa: F401

        backend = "cudf"
    except ImportError:
        backend = "pandas"
    assert f"backend={backend}," in text and "query " in text and "rows" in text
