"""A sweep's report: mean ± sd over seeds, trend checks, Markdown tables, ``results.md`` and
``summary.json`` (see :mod:`experiments.common.sweep`)."""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments.common import metrics as metrics_lib

__all__ = [
    "check",
    "checks_markdown",
    "command_line",
    "format_cell",
    "format_mean_sd",
    "markdown_table",
    "mean_sd",
    "write_sweep_results",
]


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample standard deviation)`` in float64; the sd of a single value is 0.

    Raises:
      ValueError: ``values`` is empty.
    """
    v = np.asarray(values, np.float64)
    if v.size == 0:
        raise ValueError("mean_sd needs at least one value (did every cell of the group run?)")
    return float(v.mean()), (float(v.std(ddof=1)) if v.size > 1 else 0.0)


def format_mean_sd(values: Sequence[float], digits: int = 3) -> str:
    """``"mean ± sd"`` with ``digits`` decimals (see :func:`mean_sd`)."""
    m, s = mean_sd(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def check(criterion: str, reproduced: Any, evidence: str = "") -> dict[str, Any]:
    """One trend check: a claim of the paper, whether it reproduced (bool or a measured value)."""
    return {"criterion": criterion, "reproduced": reproduced, "evidence": evidence}


def format_cell(x: Any, digits: int = 3) -> str:
    """A table cell: floats with ``digits`` decimals (``inf``), booleans as yes / **no**."""
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.{digits}f}"
    return str(x).replace("|", "\\|")  # a '|' in a cell would split it


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]], *, digits: int = 3
) -> str:
    """A Markdown table: ``columns`` are ``(heading, key)`` pairs; floats with ``digits`` decimals,
    booleans as yes / **no**, missing keys blank."""
    lines = ["| " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(format_cell(r.get(k, ""), digits) if k else "" for _, k in columns)
            + " |"
        )
    return "\n".join(lines)


def checks_markdown(checks: Sequence[Mapping[str, Any]]) -> str:
    """The trend-check table (criterion, reproduced, evidence) of :func:`check` records."""
    cols = [("criterion", "criterion"), ("reproduced", "reproduced")]
    if any(c.get("evidence") for c in checks):
        cols.append(("evidence", "evidence"))
    rows = [  # a measured value (a ratio, a best method) is shown as measured
        {
            **c,
            "reproduced": c["reproduced"]
            if isinstance(c["reproduced"], bool)
            else str(c["reproduced"]),
        }
        for c in checks
    ]
    return markdown_table(rows, cols)


def command_line(default: str) -> str:
    """The ``python -m experiments.train ...`` command of this process, else ``default``.

    Results tables quote it, so a table made by a ``:smoke`` run or with ``--config.*`` overrides
    says so (``default`` is used when the run was started from Python, e.g. a test).
    """
    argv = sys.argv
    if argv and argv[0].endswith(os.path.join("experiments", "train.py")):
        return " ".join(["python -m experiments.train", *map(shlex.quote, argv[1:])])
    return default


def write_sweep_results(
    workdir: str | os.PathLike,
    table: Sequence[Mapping[str, Any]],
    checks: Sequence[Mapping[str, Any]],
    *,
    title: str,
    columns: Sequence[str],
    command: str,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes ``results.md`` (table, command, trend checks) and ``summary.json``.

    Args:
      workdir: the run directory.
      table: one row per method/setting (mean ± sd strings, counts, ...).
      checks: :func:`check` records.
      title: the heading of ``results.md``.
      columns: the table's column order.
      command: the command that reproduces the table.
      extra: further headline numbers (listed below the checks and returned).

    Returns:
      The headline numbers: ``{"rows": len(table), <criterion>: reproduced, ..., **extra}`` with
      every value a JSON scalar.
    """
    notes = f"Command: `{command}`\n\nTrend checks (specs):\n\n" + checks_markdown(checks)
    if extra:
        notes += "\n\n" + "\n".join(f"- {k}: {v}" for k, v in extra.items())
    metrics_lib.write_results_md(workdir, table, title=title, columns=columns, notes=notes)
    by_name = {c["criterion"]: c["reproduced"] for c in checks}
    metrics_lib.write_json(
        os.path.join(os.fspath(workdir), "summary.json"),
        {"table": list(table), "checks": list(checks), **({"extra": dict(extra)} if extra else {})},
    )
    out = {"rows": len(table), **by_name, **(extra or {})}
    return {k: (v if isinstance(v, int | float | str | bool) else str(v)) for k, v in out.items()}
