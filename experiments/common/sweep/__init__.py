"""Grid sweeps of many small cells: a resumable cell store, a ``lax.scan`` trainer, reporting.

A study whose claim is a trend over methods, budgets, ranks and seeds (KGE, FrameFT, LoRA-DA,
SBVI) runs hundreds of *cells*, each a few hundred optimiser steps on a small model: too small
for :func:`experiments.common.fit` (a checkpoint per cell would cost more than the cell). The
shared pieces:

* :class:`CellStore`: ``cells.get(key, fn)`` returns the stored metrics of a finished cell or runs
  ``fn()`` and persists its result atomically as ``<workdir>/cells/<key>.json``, so an interrupted
  sweep resumes by rerunning the same command (finished cells are read back, never recomputed);
* :func:`train_scan`: ``steps`` optimiser steps of a ``(trainable, frozen)`` pair over minibatch
  indices, one jitted ``lax.scan`` (compiled once per loss, optimizer and shape), with the
  full-training-set loss after every step; :func:`batch_indices` draws the epochs' minibatches;
  :func:`train_epochs` drives a library's jitted epoch function instead (KGE);
* the cost of the trainers (examples/s, FLOPs per step, utilisation, peak memory; see
  :mod:`experiments.common.cost`) goes to each newly computed cell's ``metrics.jsonl`` record as
  ``<key>/cost/<name>`` and to the run's cost table: the store and the trainers its cells call
  are given the run's :class:`~experiments.common.options.TrainOptions`, whose log collects the
  rows;
* :func:`mean_sd` / :func:`format_mean_sd`: mean ± sample standard deviation over seeds;
* :func:`check`, :func:`checks_markdown`, :func:`markdown_table` and :func:`write_sweep_results`:
  the trend checks of a paper's claims marked as reproduced or not, next to the results table.

Example::

    cells = sweep.CellStore(workdir, options=options)
    accs = [cells.get(f"{m}/seed={s}", lambda m=m, s=s: run_cell(m, s, options))["accuracy"]
            for m in methods for s in seeds]
"""

from experiments.common.sweep.cells import CellStore, check_config
from experiments.common.sweep.scan import (
    adam,
    batch_indices,
    train_epochs,
    train_scan,
    train_scan_step,
)
from experiments.common.sweep.tables import (
    check,
    checks_markdown,
    command_line,
    format_cell,
    format_mean_sd,
    markdown_table,
    mean_sd,
    write_sweep_results,
)

__all__ = [
    "CellStore",
    "adam",
    "batch_indices",
    "check",
    "check_config",
    "checks_markdown",
    "command_line",
    "format_cell",
    "format_mean_sd",
    "markdown_table",
    "mean_sd",
    "train_epochs",
    "train_scan",
    "train_scan_step",
    "write_sweep_results",
]
