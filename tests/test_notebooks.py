"""The CPU notebooks execute top to bottom, so they cannot rot."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the [test] extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the [test] extra (nbclient)")

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


@pytest.mark.parametrize("name", ["quickstart.ipynb"])
def test_notebook_runs(name, tiny_model, monkeypatch):
    monkeypatch.setenv("SURGE_NOTEBOOK_MODEL", tiny_model)
    monkeypatch.setenv("SURGE_NOTEBOOK_ROWS", "600")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "and encoded 2" in outputs
