"""Every notebook in colabs/ runs top to bottom (in smoke mode) and is committed without outputs."""

from __future__ import annotations

import pathlib

import nbformat
import pytest

from experiments.tools import colab_cells

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
        f"{path.name}: run python -m experiments.tools.colab_cells"
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
def test_notebook_executes_in_smoke_mode(path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("LOWRANK_JAX_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # Several devices, so that the sharded code paths run: 2 rather than a Colab TPU's 8, which on
    # a 2-core CPU made the notebooks about a quarter slower (more SPMD partitions and threads).
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    # Started in colabs/, as Jupyter starts a notebook's kernel: the install cell finds the
    # checkout above it, changes into it and installs nothing.
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors, errors[0]["evalue"] if errors else ""
    install = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert install == f"working directory: {REPO}\n", install
    devices = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert devices.startswith("backend: cpu | 2 devices:"), devices
