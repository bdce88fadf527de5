"""Every notebook in colabs/ runs top to bottom (in smoke mode) and is committed without outputs."""

from __future__ import annotations

import pathlib

import nbformat
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "colabs").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "colabs/ holds no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean_and_starts_right(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), (
        f"{path.name} is committed with outputs: clear them (Kernel > Restart & Clear Output)"
    )
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "start with a title"
    install = code[0].source
    assert "import lowrank_jax" in install and "except ImportError" in install
    assert "!pip install" in install


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_in_smoke_mode(path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("LOWRANK_JAX_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    )
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
