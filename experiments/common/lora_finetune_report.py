"""Reporting of the fine-tuning experiment (``experiments/lora_finetune.py``): ``results.md`` and
the loss/accuracy plots of one run."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from experiments.common.metrics import write_results_md
from experiments.common.plots import plot_metrics

__all__ = ["write_report"]


def write_report(
    config: Any, workdir: str, final: Mapping[str, Any], history: Sequence[Mapping[str, Any]]
) -> None:
    """Writes ``results.md`` (one row: the method's size, accuracies and step time) and a
    ``<name>.png`` curve per metric of ``history`` (``loss.png``, ``accuracy.png``, ...).

    Args:
      config: the run's config (``model.name``, ``data.name``, ``data.batch_size``).
      workdir: the run directory.
      final: the run's final metrics (``method``, ``trainable_params``, ``total_params``,
        ``test/accuracy``, ``test/loss``, ``step_time_s``, ``steps``, optional
        ``valid/accuracy``).
      history: ``fit``'s logged metrics.
    """
    row = {
        "method": final["method"],
        "trained params": final["trainable_params"],
        "% of model": 100.0 * final["trainable_params"] / final["total_params"],
        "valid accuracy": final.get("valid/accuracy", math.nan),
        "test accuracy": final["test/accuracy"],
        "test loss": final["test/loss"],
        "step time (s)": final["step_time_s"],
        "steps": final["steps"],
    }
    title = f"{config.model.name} on {config.data.name}: {final['method']}"
    notes = (
        f"Batch {config.data.batch_size}, {jax.device_count()} device(s) "
        f"({jax.devices()[0].platform}); step time is the mean wall time of a training step "
        "after compilation, evaluation excluded."
    )
    write_results_md(workdir, [row], title=title, notes=notes)
    plot_metrics(workdir, history, title_prefix=f"{config.data.name} {final['method']}: ")
