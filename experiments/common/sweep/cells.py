"""The resumable cell store of a sweep: one JSON file per finished cell (see
:mod:`experiments.common.sweep`)."""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import jax
from absl import logging

from experiments.common import config_checks
from experiments.common import cost as cost_lib
from experiments.common import metrics as metrics_lib
from experiments.common.options import TrainOptions

__all__ = ["CellStore", "check_config"]


def check_config(config: Any) -> None:
    """Checks the keys every seeded sweep of small cells has (``seed``, ``eval.num_seeds``,
    ``schedule.num_steps``, ``data.batch_size``, ``data.num_train``, ``ckpt.resume``).

    Raises:
      experiments.common.ConfigError: naming the first bad key.
    """
    config_checks.check_nonnegative(config, "seed", integer=True)
    config_checks.check_positive(config, "eval.num_seeds", integer=True)
    config_checks.check_positive(config, "schedule.num_steps", integer=True)
    config_checks.check_positive(config, "data.batch_size", integer=True)
    config_checks.check_positive(config, "data.num_train", integer=True)
    config_checks.check_choice(config, "ckpt.resume", (True, False))


# ----------------------------------------------------------------------------------------------
# The resumable cell store.


def _filename(key: str) -> str:
    return urllib.parse.quote(key, safe="-_.=@,") + ".json"


def _write_cell(path: str, obj: Any) -> None:
    """Writes a cell's JSON atomically (temporary file + ``os.replace``), on process 0 only.

    Unlike ``metrics.write_json`` it keeps NaN (Python's JSON reads it back): a diverged cell
    stays NaN and shows as such in the means, as in the run that computed it.
    """
    if jax.process_index() != 0:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


class CellStore:
    """The finished cells of a sweep, one JSON file each under ``<workdir>/cells/``.

    Args:
      workdir: the run directory.
      options: the run's options (default ``TrainOptions()``): a newly computed cell reports the
        run's start (``options.log.started()``) and its metrics hold the cost of the rows that
        its trainers, given the same options, added to ``options.log``.
      resume: read back cells finished by an earlier run (False: recompute and overwrite them).
      log_metrics: append each newly finished cell's scalar metrics to ``metrics.jsonl`` as
        ``<key>/<name>`` (step = number of cells finished so far).

    Attributes:
      cells: ``{key: metrics}`` of the cells computed or read back so far, in that order.
      computed: the keys computed (not read back) by this process.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        options: TrainOptions | None = None,
        resume: bool = True,
        log_metrics: bool = True,
    ):
        self.options = TrainOptions() if options is None else options
        self.directory = os.path.join(os.fspath(workdir), "cells")
        os.makedirs(self.directory, exist_ok=True)
        self.resume = resume
        self.cells: dict[str, dict[str, Any]] = {}
        self.computed: list[str] = []
        self._writer = None
        if log_metrics:
            start = len(os.listdir(self.directory)) if resume else 0
            self._writer = metrics_lib.MetricWriter(workdir, start_step=start, tensorboard=False)
            self._step = start

    def path(self, key: str) -> str:
        """The file that holds (or will hold) the cell ``key``."""
        return os.path.join(self.directory, _filename(key))

    def __contains__(self, key: str) -> bool:
        return key in self.cells or (self.resume and os.path.exists(self.path(key)))

    def get(self, key: str, fn: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
        """The metrics of cell ``key``: read back if finished, else ``fn()``, stored atomically.

        ``fn`` must return a JSON-serialisable mapping (numbers, strings, lists, dicts).
        """
        if key in self.cells:
            return self.cells[key]
        path = self.path(key)
        if self.resume and os.path.exists(path):
            with open(path) as f:
                self.cells[key] = json.load(f)
            return self.cells[key]
        first = len(self.options.log.rows)
        result = json.loads(json.dumps(dict(fn()), default=str))  # what a rerun reads back
        costs = self.options.log.rows[first:]  # the cost of the trainers that fn called
        self.options.log.started()  # a cell trained: the runner may write config.json
        _write_cell(path, result)
        self.cells[key] = result
        self.computed.append(key)
        if self._writer is not None:
            self._step += 1
            scalars = {
                f"{key}/{k}": v
                for k, v in result.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
            if costs:
                cell_cost = cost_lib.summarise(costs, peak=self.options.peak_tflops)
                scalars.update({f"{key}/{k}": v for k, v in cell_cost.items()})
            if scalars:
                self._writer.write(self._step, scalars)
        logging.info("cell %s: %s", key, _short(result))
        return result

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _short(result: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if isinstance(v, int | float | str | bool)}
