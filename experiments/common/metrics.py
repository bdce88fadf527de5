"""Outputs a person can look at: ``metrics.jsonl``, TensorBoard events, ``config.json``, ``results.md``.

Only process 0 writes files (every process may call these functions). Example::

    writer = MetricWriter(workdir, start_step=restored_step)
    writer.write(step, {"train/loss": 0.31, "valid/accuracy": 0.9})
    writer.close()
    records = read_metrics(workdir)   # [{"step": 10, "train/loss": 0.31, ...}, ...]
    write_results_md(workdir, [{"method": "lora", "test accuracy": 0.91}], title="LoRA")

``metrics.jsonl`` holds one JSON object per line, ``{"step": int, "<split>/<name>": float, ...}``.
TensorBoard event files go to ``<workdir>/tensorboard`` (tensorboardX; no TensorFlow needed).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "MetricWriter",
    "json_safe",
    "read_metrics",
    "to_scalars",
    "write_config_json",
    "write_json",
    "write_results_md",
]

METRICS_FILE = "metrics.jsonl"


def _is_writer() -> bool:
    return jax.process_index() == 0


def _summary_writer_class() -> type:
    """``tensorboardX.SummaryWriter``, imported without PyTorch.

    tensorboardX imports torch, when it is installed (the ``peers`` extra), only to accept torch
    tensors; we write Python floats, and importing torch costs seconds and ~0.5 GB in every run.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Converts a dict of scalar arrays / numbers to plain Python floats (ints stay ints)."""
    out = {}
    for k, v in metrics.items():
        v = np.asarray(jax.device_get(v))
        if v.size != 1:
            raise ValueError(f"metric {k!r} has shape {v.shape}: metrics must be scalars")
        v = v.reshape(()).item()
        out[k] = v if isinstance(v, int | bool) else float(v)
    return out


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``<workdir>/metrics.jsonl`` in order (an empty list if there is none)."""
    path = os.path.join(os.fspath(workdir), METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricWriter:
    """Appends scalar metrics to ``metrics.jsonl`` and TensorBoard, consistently across resumes.

    On a resumed run (``start_step > 0``) the records after ``start_step`` (written by a run that
    was killed after its last checkpoint) are dropped from ``metrics.jsonl`` and purged from
    TensorBoard, so the files read as one uninterrupted run.

    Args:
      workdir: the run directory.
      start_step: the step training (re)starts from (0 for a fresh run).
      tensorboard: also write TensorBoard event files under ``<workdir>/tensorboard``.
    """

    def __init__(
        self, workdir: str | os.PathLike, *, start_step: int = 0, tensorboard: bool = True
    ) -> None:
        self.workdir = os.fspath(workdir)
        self.path = os.path.join(self.workdir, METRICS_FILE)
        self._tb = None
        if not _is_writer():
            return
        os.makedirs(self.workdir, exist_ok=True)
        kept = [r for r in read_metrics(self.workdir) if r["step"] <= start_step]
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:  # rewritten atomically: a crash here loses no kept row
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)
        if tensorboard:
            self._tb = _summary_writer_class()(
                logdir=os.path.join(self.workdir, "tensorboard"),
                purge_step=start_step + 1 if start_step else None,
                flush_secs=30,
            )

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Writes scalar ``metrics`` at ``step``; returns them as Python floats."""
        scalars = to_scalars(metrics)
        if not _is_writer():
            return scalars
        record = {"step": int(step), **scalars}
        with open(self.path, "a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, int(step))
        return scalars

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """Writes a text summary (e.g. the config or the results table) to TensorBoard."""
        if self._tb is not None:
            self._tb.add_text(tag, text, step)

    def close(self) -> None:
        """Flushes and closes the TensorBoard writer."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def skipped_steps(records: Sequence[Mapping[str, Any]]) -> int:
    """The steps that ``fit`` skipped (``train/skipped_steps``) over ``metrics.jsonl`` records."""
    return int(sum(r.get("train/skipped_steps", 0) for r in records))


def skipped_steps_under(workdir: str | os.PathLike) -> int:
    """:func:`skipped_steps` summed over every ``metrics.jsonl`` in ``workdir`` and below it
    (a continual run keeps one per method, seed and task)."""
    return sum(
        skipped_steps(read_metrics(root))
        for root, _, files in os.walk(os.fspath(workdir))
        if METRICS_FILE in files
    )


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/Inf floats replaced by None, so ``json.dumps`` writes valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Writes ``obj`` as indented JSON (process 0 only; NaN/Inf become null), atomically."""
    if not _is_writer():
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(json_safe(obj), f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


def write_config_json(workdir: str | os.PathLike, config: Any) -> dict[str, Any]:
    """Writes ``<workdir>/config.json`` and returns the JSON-round-tripped dict.

    Args:
      workdir: the run directory.
      config: an ``ml_collections.ConfigDict`` (or dict).

    Returns:
      The config as plain JSON types (tuples become lists), as stored.
    """
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    as_json = json.loads(json.dumps(raw, default=str))
    write_json(os.path.join(os.fspath(workdir), "config.json"), as_json)
    return as_json


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_results_md(
    workdir: str | os.PathLike,
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str,
    columns: Sequence[str] | None = None,
    notes: str = "",
    filename: str = "results.md",
) -> str:
    """Writes a Markdown results table to ``<workdir>/<filename>`` and returns its text.

    Args:
      workdir: the run directory.
      rows: one mapping per table row; missing cells are left blank.
      title: the heading.
      columns: column order (default: keys in first-seen order).
      notes: Markdown appended below the table (e.g. the command that produced it).
      filename: output file name.

    Returns:
      The Markdown text.
    """
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |"]
    lines.append("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    text = "\n".join(lines) + "\n"
    if notes:
        text += "\n" + notes.strip() + "\n"
    if _is_writer():
        os.makedirs(os.fspath(workdir), exist_ok=True)
        with open(os.path.join(os.fspath(workdir), filename), "w") as f:
            f.write(text)
    return text
