"""Every notebook in colabs/ runs top to bottom (in smoke mode) and is committed without outputs;
its executed copy in docs/notebooks/ (rendered by the site) is current."""

from __future__ import annotations

import pathlib

import nbformat
import pytest

from tools import colab_cells, render_notebooks

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
    # Badge, install cell and devices cell are exactly what colab_cells generates from setup.cfg.
    assert nb.cells[:3] == colab_cells.expected_cells(path).cells[:3], (
        f"{path.name}: run python -m tools.colab_cells"
    )
    url = colab_cells.repo_url()
    title, install, devices = (c.source for c in nb.cells[:3])
    assert title.startswith("# ")
    assert (
        f"(https://colab.research.google.com/github/{url[19:]}/blob/main/colabs/{path.name})"
        in (title.split("\n")[2])
    )
    lines = install.splitlines()
    assert f'repository = "{url}"' in lines
    assert '        shell("git", "clone", "-q", "--depth=1", repository, str(checkout))' in lines
    packages = tuple(colab_cells.PACKAGES.get(path.name, ()))
    assert f"data_packages = {packages!r}".replace("'", '"') in install
    assert "!" not in install.replace("!=", "") and "%" not in install  # no magics: errors raise
    assert "jax.devices()" in devices and "jax.default_backend()" in devices


def test_colab_cells_cover_exactly_the_notebooks():
    assert set(colab_cells.PACKAGES) <= {p.name for p in NOTEBOOKS}
    assert colab_cells.write(NOTEBOOKS, check=True) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_in_smoke_mode(path):
    # Smoke mode on 2 fake CPU devices (the sharded code paths run), the kernel started in
    # colabs/ as Jupyter starts it: the install cell finds the checkout above, changes into it and
    # installs nothing. The same run as the one that renders the site's copies.
    nb = render_notebooks.execute(path)  # raises CellExecutionError where a cell raises
    install = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert install == f"working directory: {REPO}\n", install
    devices = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert devices.startswith("backend: cpu | 2 devices:"), devices


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_site_copy_is_current(path):
    # The site renders docs/notebooks/<name> (executed, with outputs): the same cells as the colab,
    # every code cell run in order without an error, and plots among the outputs.
    stored = REPO / "docs" / "notebooks" / path.name
    reason = render_notebooks.stale(path, stored)
    assert reason is None, f"{reason}: run python -m tools.render_notebooks {path.stem}"
    nb = nbformat.read(stored, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{stored.name} shows no plot"
    assert not any(str(REPO) in o.get("text", "") for o in outputs), "the checkout's path leaked"


def test_staleness_is_detected(tmp_path):
    colab = NOTEBOOKS[0]
    stored = REPO / "docs" / "notebooks" / colab.name
    assert render_notebooks.stale(colab, tmp_path / colab.name).endswith("is missing")
    nb = nbformat.read(stored, as_version=4)
    nb.cells[-1].source += "\n# edited"
    edited = tmp_path / colab.name
    nbformat.write(nb, edited)
    assert "other cells" in render_notebooks.stale(colab, edited)
    nb = nbformat.read(stored, as_version=4)
    next(c for c in reversed(nb.cells) if c.cell_type == "code").execution_count = None
    nbformat.write(nb, edited)
    assert "did not all run" in render_notebooks.stale(colab, edited)
