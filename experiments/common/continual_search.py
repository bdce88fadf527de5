r"""Hyper-parameter selection of the continual-learning experiment: one random search per method.

Every method gets the same budget: ``config.search.trials`` configurations, each a full run over
the task stream of the first seed, scored by the **validation** final average accuracy (mean of
the last row of the accuracy matrix measured on each task's validation rows). The validation rows
are carved from each task's training rows (:func:`validation_stream`,
``config.data.valid_fraction`` per class); a search run trains on the remaining training rows and
never sees a test row (the search stream has no test split at all). The chosen values are then
used for every seed of the reported run, which trains on the full training rows (validation
included, the usual refit after selection) and is scored on test.

The space (:data:`SPACES`): every method's learning rate, log-uniform in ``[lr₀/5, 5·lr₀]`` around
the benchmark's configured rate ``lr₀``, plus its own knobs:

=========  ===============================================================================
saber      κ = ``saber.energy_strength`` ~ U[0, 8]; damping γ = ``saber.gamma`` ~ U[0, 1];
           ``saber.lambda_align`` ~ logU[0.1, 10]
gr_lora    ``memory_threshold`` ~ U[0.90, 0.995]; ``gr_lora.lambda_local``,
           ``gr_lora.lambda_global`` ~ logU[0.05, 2]
o_lora     λ = ``o_lora.lambda_orth`` ~ logU[0.05, 5]
inflora    ε = ``memory_threshold`` ~ U[0.90, 0.995]
gpm_lora   ``memory_threshold`` ~ U[0.90, 0.995]
sd_lora,   the learning rate only (SD-LoRA's magnitudes are learned; sequential LoRA and
seq_lora,  joint training have no other knob)
joint
=========  ===============================================================================

Trial ``i`` of every method draws from ``numpy.random.default_rng([config.search.seed, i])``,
the learning rate first, so trial ``i`` has the same learning rate for every method (common
random numbers) and the draws do not depend on the test data, the method order or the other
methods. The configured defaults are not a candidate (SABER's were chosen on split_digits).
Ties go to the lower trial index.

The head (``config.head``: masked, aligned, prototype) can be a dimension of the search too:
with ``config.search.heads`` non-empty (``configs/saber.py:compare_heads``) every trial is run
once per listed head (the same trial values for each head), and the head is chosen with the other
values by validation final accuracy; with ``config.search.trials = 0`` the trials are just the
configured values, so the run compares the heads alone, on validation
(:func:`experiments.common.continual_report.heads_markdown` tabulates every method × head).
Finished trials are stored by :class:`experiments.common.sweep.CellStore` under
``<workdir>/search/``, so a search resumes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from experiments.common import sweep
from experiments.common.options import TrainOptions
from lowrank_jax.continual import TaskStream as Stream

__all__ = [
    "SPACES",
    "apply_values",
    "candidates",
    "sample_trials",
    "search",
    "valid_indices",
    "validation_stream",
]

_THRESHOLD = ("method.memory_threshold", "uniform", 0.90, 0.995)
# per method: (config path, distribution, low, high) beside the learning rate
SPACES: dict[str, tuple[tuple[str, str, float, float], ...]] = {
    "saber": (
        ("method.saber.energy_strength", "uniform", 0.0, 8.0),
        ("method.saber.gamma", "uniform", 0.0, 1.0),
        ("method.saber.lambda_align", "log", 0.1, 10.0),
    ),
    "gr_lora": (
        _THRESHOLD,
        ("method.gr_lora.lambda_local", "log", 0.05, 2.0),
        ("method.gr_lora.lambda_global", "log", 0.05, 2.0),
    ),
    "o_lora": (("method.o_lora.lambda_orth", "log", 0.05, 5.0),),
    "inflora": (_THRESHOLD,),
    "gpm_lora": (_THRESHOLD,),
    "sd_lora": (),
    "seq_lora": (),
    "joint": (),
}
LR_FACTOR = 5.0  # the learning rate is drawn log-uniformly in [lr0 / 5, 5 lr0]


def valid_indices(
    y: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(fit, valid)`` row indices of a training set with labels ``y``, stratified by class.

    Each class with ``n_c`` rows gives ``round(fraction * n_c)`` of them (at least one, at most
    ``n_c - 1``; none if ``n_c = 1``) to ``valid``, drawn by ``rng``; the rest stay in ``fit``.
    Both are sorted and partition ``range(len(y))``.
    """
    valid = []
    for c in np.unique(y):
        rows = np.flatnonzero(y == c)
        k = min(max(int(round(fraction * len(rows))), 1), len(rows) - 1)
        valid.append(rng.choice(rows, k, replace=False))
    valid = np.sort(np.concatenate(valid)) if valid else np.zeros(0, int)
    return np.setdiff1d(np.arange(len(y)), valid), valid


def validation_stream(stream: Stream, *, fraction: float, seed: int) -> Stream:
    """The stream of the hyper-parameter search: ``train`` the fit rows, ``test`` the valid rows.

    Each task's training rows are split by :func:`valid_indices` (``rng = default_rng([seed,
    t, 23])``, so deterministic in the seed); the test rows are not used. Sizes with the default
    ``config.data.valid_fraction = 0.15``: split_digits 203 of 1,348 rows per task, digits_cil
    about 40 of 270, long_stream 75 of 500, shakespeare_plays 60 of 400, split_mnist 150 per
    increment class (task 0: 15% of its 200/1,000 images per class), mnist_cil 300 of 2,000.
    """
    tasks = []
    for t, task in enumerate(stream.tasks):
        train = task["train"]
        fit, valid = valid_indices(train["y"], fraction, np.random.default_rng([seed, t, 23]))
        tasks.append(
            {
                # np.take keeps inputs read on demand (data.ImageRows) lazy
                "train": {k: np.take(v, fit, axis=0) for k, v in train.items()},
                "test": {k: np.take(v, valid, axis=0) for k, v in train.items()},
            }
        )
    return dataclasses.replace(stream, tasks=tasks)


def sample_trials(config: Any, method: str) -> list[dict[str, float]]:
    """The ``config.search.trials`` candidate settings of ``method`` (``{config path: value}``)."""
    if method not in SPACES:
        raise ValueError(f"no search space for method {method!r}: known are {sorted(SPACES)}")
    lr0 = float(config.optim.learning_rate)
    trials = []
    for i in range(config.search.trials):
        rng = np.random.default_rng([config.search.seed, i])
        u = rng.uniform(-1.0, 1.0)  # first draw: the learning rate, common to all methods
        values = {"optim.learning_rate": float(lr0 * LR_FACTOR**u)}
        for path, kind, low, high in SPACES[method]:
            if kind == "log":
                values[path] = float(np.exp(rng.uniform(np.log(low), np.log(high))))
            else:
                values[path] = float(rng.uniform(low, high))
        trials.append(values)
    return trials


def candidates(config: Any, method: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``(cell key, run directory name, values)`` of every setting ``method``'s search runs, in order.

    The :func:`sample_trials` (or, with ``config.search.trials = 0``, the configured values as the
    one trial) crossed with the heads of ``config.search.heads`` (if any; ``values["head"]``).
    """
    trials = sample_trials(config, method)
    heads = tuple(config.search.heads)
    if not heads:
        return [(f"{method}/trial={i}", f"t{i}", v) for i, v in enumerate(trials)]
    trials = trials or [{}]
    return [
        (f"{method}/trial={i}/head={h}", f"t{i}_{h}", {**v, "head": h})
        for i, v in enumerate(trials)
        for h in heads
    ]


def apply_values(config: Any, values: Mapping[str, Any]) -> Any:
    """A copy of ``config`` with ``{dotted path: value}`` set (the original is not changed)."""
    out = config.copy_and_resolve_references()
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ValueError(f"search value for unknown config key {path!r}")
        node[leaf] = value
    return out


RunFn = Callable[..., dict[str, Any]]


def search(
    config: Any,
    method: str,
    stream: Stream,
    run_fn: RunFn,
    workdir: str,
    *,
    options: TrainOptions,
) -> dict[str, Any] | None:
    """Runs ``method``'s trials on the validation stream of ``stream``; returns the choice.

    Args:
      config: the experiment config (``search.trials``, ``search.seed``, ``data.valid_fraction``).
      method: the method's name.
      stream: the task stream of the search seed (its test rows are not used).
      run_fn: ``(*, config, stream, workdir) -> {"R": accuracy matrix, "interrupted": bool}``, one
        run of ``method`` (``experiments.continual.run_method``).
      workdir: the run directory; trials live in ``<workdir>/search/``.
      options: the run's options (the trials' store reports the run's start to them).

    Returns:
      ``{"values": chosen {path: value}, "valid_final_acc": its score, "trials": [{"values",
      "valid_final_acc"}, ...]}``, or None if a trial was interrupted.
    """
    valid = validation_stream(stream, fraction=config.data.valid_fraction, seed=config.seeds[0])
    root = os.path.join(workdir, "search")
    cells = sweep.CellStore(root, options=options, log_metrics=False)
    scored = []
    for key, name, values in candidates(config, method):
        if key not in cells:
            wd = os.path.join(root, method, name)
            out = run_fn(config=apply_values(config, values), stream=valid, workdir=wd)
            if out["interrupted"]:
                return None
            acc = float(np.mean(np.asarray(out["R"])[-1]))
            cells.get(key, lambda v=values, a=acc: {"values": v, "valid_final_acc": a})
        scored.append(cells.get(key, dict))
    if not scored:
        return {"values": {}, "valid_final_acc": math.nan, "trials": []}
    best = max(range(len(scored)), key=lambda i: (scored[i]["valid_final_acc"], -i))
    return {**scored[best], "trial": best, "trials": scored}
