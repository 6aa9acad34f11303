"""The CPU notebooks execute top to bottom, so they cannot rot."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the [test] extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the [test] extra (nbclient)")

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


def _run(name, tiny_model, monkeypatch):
    monkeypatch.setenv("SURGE_NOTEBOOK_MODEL", tiny_model)
    monkeypatch.setenv("SURGE_NOTEBOOK_ROWS", "600")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    return nb


def _text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_quickstart_notebook_runs(tiny_model, monkeypatch):
    nb = _run("quickstart.ipynb", tiny_model, monkeypatch)
    assert "and encoded 2" in _text(nb)
    # progress is an HTML bar updated in place in a notebook, not a stream of text lines
    html = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.get("output_type") in ("display_data", "update_display_data") and "text/html" in o.get("data", {})]
    assert any("<progress" in h and "SuperBatches" in h for h in html)


def test_rapids_notebook_runs_on_the_cpu_fallback(tiny_model, monkeypatch):
    nb = _run("rapids.ipynb", tiny_model, monkeypatch)
    text = _text(nb)
    try:
        import cudf  # noqa: F401
        backend = "cudf"
    except ImportError:
        backend = "pandas"
    assert f"backend={backend}," in text and "query " in text and "rows" in text
