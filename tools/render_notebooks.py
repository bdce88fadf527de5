"""Executes the notebooks of ``colabs/`` in smoke mode and stores them, outputs included, in ``docs/``.

    python -m tools.render_notebooks                     # every notebook
    python -m tools.render_notebooks 02_fp8_scaling      # some of them
    python -m tools.render_notebooks --check             # exit 1 where one is stale

``colabs/*.ipynb`` are committed without outputs (``tests/test_notebooks.py`` checks it); the site
renders the executed copies ``docs/notebooks/*.ipynb``, which this module writes: each notebook run
top to bottom in smoke mode (``LOWRANK_JAX_SMOKE=1``) on 2 fake CPU devices, with its kernel
started in ``colabs/`` as Jupyter starts it (the environment of :data:`SMOKE_ENV`, the same run as
the test suite's). The checkout's absolute path in the outputs is written as ``<checkout>``.

A stored copy is current when its cells are the colab's cells (same kinds and sources, in order)
and every code cell ran, in order, without an error (:func:`stale`). The test suite and the site
build (``docs/conf.py``) check this; after editing a notebook, rerun this module for it (the
smoke run of one notebook takes 1-5 minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
from collections.abc import Iterator

import nbformat

__all__ = ["SMOKE_ENV", "execute", "render", "stale"]

REPO = pathlib.Path(__file__).resolve().parents[1]
COLABS = REPO / "colabs"
STORED = REPO / "docs" / "notebooks"
CHECKOUT = "<checkout>"

# The environment of a smoke run: cheap configs, the CPU, and 2 devices so that the sharded code
# paths run (a Colab TPU has 8; on a 2-core CPU 8 fake devices made the notebooks a quarter slower).
# Matplotlib's inline backend, as in Jupyter (also where MPLBACKEND is set, e.g. to Agg in CI): the
# plots become image outputs that the site shows.
SMOKE_ENV = {
    "LOWRANK_JAX_SMOKE": "1",
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def execute(path: pathlib.Path, *, timeout: int = 600) -> nbformat.NotebookNode:
    """Runs the notebook at ``path`` top to bottom in smoke mode (:data:`SMOKE_ENV`).

    Args:
        path: a notebook of ``colabs/``; its kernel starts in the notebook's folder.
        timeout: seconds one cell may take.

    Returns:
        The notebook with its outputs.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised (its traceback in the message).
    """
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    with _environment(SMOKE_ENV):
        client.execute()
    return nb


def _errors(cells: list[nbformat.NotebookNode]) -> list[str]:
    return [
        f"{output.get('ename', '')}: {output.get('evalue', '')}"
        for cell in cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]


def _without_checkout_path(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                output.text = output.text.replace(str(REPO), CHECKOUT)
    return nb


def stale(colab: pathlib.Path, stored: pathlib.Path) -> str | None:
    """Why the stored executed copy of ``colab`` is not current, or None when it is.

    Args:
        colab: a notebook of ``colabs/`` (no outputs).
        stored: its executed copy in ``docs/notebooks/``.

    Returns:
        None, or a one-line reason: missing, different cells, a code cell not run (or run out of
        order), an error output.
    """
    if not stored.is_file():
        return f"{stored.name} is missing"
    want = nbformat.read(colab, as_version=4).cells
    have = nbformat.read(stored, as_version=4).cells
    if [(c.cell_type, c.source) for c in want] != [(c.cell_type, c.source) for c in have]:
        return f"{stored.name} has other cells than colabs/{colab.name}"
    counts = [c.execution_count for c in have if c.cell_type == "code"]
    if counts != list(range(1, len(counts) + 1)):
        return f"{stored.name}: its code cells did not all run, in order, in one kernel"
    errors = _errors(have)
    if errors:
        return f"{stored.name}: a cell raised {errors[0]}"
    return None


def render(path: pathlib.Path, *, timeout: int = 600) -> pathlib.Path:
    """Executes the colab at ``path`` (:func:`execute`) and writes it into ``docs/notebooks/``.

    Args:
        path: a notebook of ``colabs/``.
        timeout: seconds one cell may take.

    Returns:
        The path written.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised (nothing is written).
    """
    nb = execute(path, timeout=timeout)
    STORED.mkdir(parents=True, exist_ok=True)
    target = STORED / path.name
    nbformat.write(_without_checkout_path(nb), target)
    return target


def _select(names: list[str]) -> list[pathlib.Path]:
    paths = sorted(COLABS.glob("*.ipynb"))
    if not names:
        return paths
    chosen = [p for p in paths if p.stem in names or p.name in names]
    unknown = set(names) - {p.stem for p in chosen} - {p.name for p in chosen}
    if unknown:
        raise SystemExit(f"not a notebook of colabs/: {', '.join(sorted(unknown))}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="names in colabs/ (default: all)")
    parser.add_argument("--check", action="store_true", help="only report stale stored copies")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one cell may take")
    args = parser.parse_args(argv)
    paths = _select(args.notebooks)
    if args.check:
        reasons = [r for p in paths if (r := stale(p, STORED / p.name))]
        for reason in reasons:
            print("stale: " + reason)
        if reasons:
            sys.exit("run python -m tools.render_notebooks to re-render them")
        return
    for path in paths:
        print("wrote:", render(path, timeout=args.timeout).relative_to(REPO), flush=True)


if __name__ == "__main__":
    main()
