"""PNG plots of training curves from ``metrics.jsonl`` records (matplotlib ``Figure`` objects).

Metric keys are ``"<split>/<name>"`` (``train/loss``, ``valid/accuracy``); :func:`plot_metrics`
draws one PNG per ``<name>`` with one line per split::

    paths = plot_metrics(workdir, read_metrics(workdir))   # -> [".../loss.png", ".../accuracy.png"]
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

__all__ = ["plot_curves", "plot_heatmap", "plot_metrics"]


def subplots(nrows: int = 1, ncols: int = 1, *, figsize=None, dpi=None, squeeze: bool = True):
    """``plt.subplots`` without pyplot: a ``(Figure, axes)`` pair; the global backend (a notebook's
    inline plots) is left as it is. Save with ``fig.savefig``; there is nothing to close."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    return fig, fig.subplots(nrows, ncols, squeeze=squeeze)


def plot_curves(
    path: str | os.PathLike,
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str = "step",
    ylabel: str = "",
    logy: bool = False,
    marks: Mapping[str, float] | None = None,
    hline: float | None = None,
) -> str:
    """Draws ``{label: (xs, ys)}`` as lines into one PNG at ``path`` and returns the path.

    Args:
      path: output ``.png`` file.
      curves: label -> (x values, y values).
      title: plot title.
      xlabel: x-axis label.
      ylabel: y-axis label.
      logy: logarithmic y axis (only if all values are positive).
      marks: optional ``{label: x}`` events drawn as labelled dotted vertical lines.
      hline: optional y value drawn as a red horizontal line (e.g. a bound at 1).
    """
    # A Figure without pyplot: no global backend switch, so a notebook's inline plots keep working.
    from matplotlib.figure import Figure

    path = os.fspath(path)
    if jax.process_index() != 0:
        return path
    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.subplots()
    positive = True
    for label, (xs, ys) in curves.items():
        marker = "o" if len(xs) <= 20 else None
        ax.plot(xs, ys, label=label, marker=marker, markersize=3)
        positive = positive and all(y > 0 for y in ys)
    if logy and positive:
        ax.set_yscale("log")
    for label, x in (marks or {}).items():
        ax.axvline(x, color="k", ls=":", lw=0.8)
        ax.text(x, ax.get_ylim()[1], label, fontsize=7, va="top")
    if hline is not None:
        ax.axhline(hline, color="r", lw=0.8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


def plot_heatmap(
    path: str | os.PathLike,
    matrix: Any,
    *,
    title: str,
    xlabel: str = "",
    ylabel: str = "",
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool = True,
) -> str:
    """Draws a 2-D ``matrix`` as a heat map (NaN cells blank) into a PNG at ``path``.

    Rows run top to bottom, columns left to right, both numbered from 1. With ``annotate`` each
    finite cell shows its value (two decimals; only for matrices up to 20 x 20).
    """
    import numpy as np
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    path = os.fspath(path)
    if jax.process_index() != 0:
        return path
    m = np.asarray(matrix, np.float64)
    if m.ndim != 2:
        raise ValueError(f"plot_heatmap needs a 2-D matrix, got shape {m.shape}")
    size = max(3.5, 0.55 * max(m.shape) + 1.5)
    fig = Figure(figsize=(size + 0.8, size), dpi=100)
    ax = fig.subplots()
    im = ax.imshow(np.ma.masked_invalid(m), vmin=vmin, vmax=vmax, cmap="viridis")
    ax.set_xticks(range(m.shape[1]), [str(j + 1) for j in range(m.shape[1])])
    ax.set_yticks(range(m.shape[0]), [str(i + 1) for i in range(m.shape[0])])
    if annotate and max(m.shape) <= 20:
        mid = np.nanmean(m) if np.isfinite(m).any() else 0.0
        if vmin is not None and vmax is not None:
            mid = 0.5 * (vmin + vmax)
        for (i, j), v in np.ndenumerate(m):
            if np.isfinite(v):
                color = "k" if v > mid else "w"
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color=color)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


def plot_metrics(
    workdir: str | os.PathLike,
    records: Sequence[Mapping[str, Any]],
    *,
    names: Sequence[str] | None = None,
    title_prefix: str = "",
) -> list[str]:
    """Writes ``<workdir>/<name>.png`` for each metric name found in ``records``.

    Args:
      workdir: the run directory.
      records: ``metrics.jsonl`` records (``{"step": int, "<split>/<name>": float, ...}``).
      names: metric names to plot (default: every ``<name>`` that appears, except timings and
        the ``cost/*`` records).
      title_prefix: prepended to each plot title (e.g. the experiment name).

    Returns:
      The paths of the written PNG files.
    """
    series: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for record in records:
        for key, value in record.items():
            if "/" not in key or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            split, name = key.split("/", 1)
            if split == "cost" and names is None:  # throughput and memory: not a curve to plot
                continue
            xs, ys = series.setdefault(name, {}).setdefault(split, ([], []))
            xs.append(record["step"])
            ys.append(value)
    if names is None:
        names = [n for n in series if not n.endswith("_s") and n not in ("learning_rate",)]
    paths = []
    for name in names:
        if name not in series:
            continue
        title = f"{title_prefix}{name}"
        path = os.path.join(os.fspath(workdir), f"{name.replace('/', '_')}.png")
        paths.append(plot_curves(path, series[name], title=title, ylabel=name, logy=name == "loss"))
    return paths
