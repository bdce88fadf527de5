"""What a run costs: throughput, FLOPs, utilisation, peak memory, and a profiler trace by flag.

Every run that trains through :func:`experiments.common.fit` or the sweep trainers
(:func:`experiments.common.sweep.train_scan`, :func:`~experiments.common.sweep.train_epochs`)
reports, with its ``train/*`` records in ``metrics.jsonl`` and TensorBoard:

* ``cost/examples_per_s`` (and ``cost/tokens_per_s`` when a batch holds an integer
  ``input_ids`` or ``tokens`` array: every position counts, padding included), over the logging
  interval, measured without blocking on any step: the interval ends where ``fit`` reads the
  interval's metrics back anyway; compilation, evaluation and checkpointing are excluded;
* ``cost/flops_per_step``: XLA's cost analysis of the compiled step, summed over the devices (the
  compiled program is the per-device one);
* ``cost/tflops_per_s_per_device`` and ``cost/utilisation``: achieved TFLOP/s per device, and
  its fraction of ``config.hardware.peak_tflops`` (the peak of one device; see
  :data:`PEAK_TFLOPS`; absent when the peak is unknown, e.g. on CPU);
* ``cost/peak_device_memory_bytes`` (the largest ``peak_bytes_in_use`` of the local devices,
  where the backend reports ``device.memory_stats()``: GPU, TPU) or else
  ``cost/peak_host_rss_bytes`` (the process's peak resident set, e.g. on CPU).

The peak and the trace come from the run's :class:`~experiments.common.options.TrainOptions`
(``config.hardware``, ``config.profile``), which every trainer is given; each trainer adds its row
to the options' :class:`~experiments.common.options.RunLog`, and ``python -m experiments.train``
appends the "Cost" table of those rows (one per ``fit`` description or sweep loss) to
``<workdir>/results.md`` when the run ends (:func:`append_cost_table`).

Profiling: ``--config.profile.start_step=N --config.profile.num_steps=K`` traces the training
steps ``N .. N+K-1`` of the run's first ``fit`` that reaches step ``N`` with ``jax.profiler``
into ``<workdir>/profile`` (``plugins/profile/<session>/*.xplane.pb``), which TensorBoard's
profile plugin opens: ``tensorboard --logdir <workdir>/profile``.

A note on sweeps: XLA's cost analysis counts the body of a loop (``lax.scan``) once, so the FLOPs
of a ``train_scan`` program are those of one of its steps (with the per-step trace loss when
``trace=True``); ``tests/experiments/test_cost.py`` checks that this holds.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from experiments.common.options import TrainOptions

__all__ = [
    "PEAK_TFLOPS",
    "StepMeter",
    "append_cost_table",
    "batch_size_of",
    "compiled_flops",
    "cost_table",
    "peak_memory",
    "peak_tflops",
    "program_flops",
    "record_steps",
    "summarise",
    "timed_call",
]

# Peak dense bf16 TFLOP/s of one JAX device, by a lower-case substring of ``device_kind`` (first
# match wins, so the more specific names come first). Vendors' data sheets: Cloud TPU v4 275,
# v5e 197, v5p 459, v6e (Trillium) 918 per chip; NVIDIA A100 312, H100 SXM 989 (PCIe 756), H200
# 989 (dense, without sparsity).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("v6 lite", 918.0),  # TPU v6e reports "TPU v6 lite"
    ("v6e", 918.0),
    ("v5 lite", 197.0),  # TPU v5e reports "TPU v5 lite"
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("tpu v5", 459.0),  # TPU v5p reports "TPU v5"
    ("tpu v4", 275.0),
    ("h200", 989.0),
    ("h100 pcie", 756.0),
    ("h100", 989.0),
    ("a100", 312.0),
)

_TOKEN_KEYS = ("input_ids", "tokens")


def peak_tflops(device_kind: str | None = None) -> float | None:
    """The peak dense bf16 TFLOP/s of one device of ``device_kind`` (default: the first device's),
    from :data:`PEAK_TFLOPS`; None when unknown (CPU, other accelerators)."""
    kind = (jax.devices()[0].device_kind if device_kind is None else device_kind).lower()
    return next((peak for name, peak in PEAK_TFLOPS if name in kind), None)


def peak_memory() -> dict[str, float]:
    """``{"cost/peak_device_memory_bytes": ...}`` where the local devices report memory stats,
    else ``{"cost/peak_host_rss_bytes": ...}`` (the peak RSS of this process)."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # a backend without the call
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    if peaks:
        return {"cost/peak_device_memory_bytes": float(max(peaks))}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"cost/peak_host_rss_bytes": float(rss if sys.platform == "darwin" else rss * 1024)}


def compiled_flops(compiled: Any) -> float | None:
    """The FLOPs of one execution of a compiled program on one device (XLA's cost analysis), or
    None where the backend does not report them."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(analysis, Sequence):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops is not None and flops >= 0 else None


def batch_size_of(batch: Any) -> tuple[int, int]:
    """``(examples, tokens)`` of a batch: the leading axis of its arrays, and the size of an
    integer ``input_ids``/``tokens`` entry with a sequence axis (0 when there is none)."""
    leaves = [x for x in jax.tree.leaves(batch) if np.ndim(x) >= 1]
    examples = int(np.shape(leaves[0])[0]) if leaves else 0
    tokens = 0
    if isinstance(batch, Mapping):
        for key in _TOKEN_KEYS:
            x = batch.get(key)
            dtype = getattr(x, "dtype", None)
            if x is not None and np.ndim(x) >= 2 and np.issubdtype(dtype, np.integer):
                tokens = int(np.size(x))
                break
    return examples, tokens


# ----------------------------------------------------------------------------------------------
# The run's cost records (in its TrainOptions' RunLog) and its cost table.


def _record(options: TrainOptions, row: dict[str, Any]) -> None:
    options.log.rows.append(row)


def append_cost_table(workdir: str | os.PathLike, options: TrainOptions) -> None:
    """Appends the cost table of the run's trainers (``options.log.rows``) to
    ``<workdir>/results.md``, if the run wrote one and a trainer ran (process 0 only)."""
    path = os.path.join(os.fspath(workdir), "results.md")
    if options.log.rows and jax.process_index() == 0 and os.path.exists(path):
        with open(path, "a") as f:
            f.write("\n" + cost_table(options.log.rows, peak=options.peak_tflops) + "\n")


def _rates(
    steps: float,
    seconds: float,
    examples: float,
    tokens: float,
    flops: float | None,
    peak: float | None,
) -> dict[str, float]:
    """Throughput, FLOPs and utilisation of ``steps`` steps that took ``seconds``."""
    out: dict[str, float] = {}
    if steps > 0 and seconds > 0:
        out["cost/examples_per_s"] = examples * steps / seconds
        if tokens:
            out["cost/tokens_per_s"] = tokens * steps / seconds
    if flops is not None:
        n = jax.device_count()
        out["cost/flops_per_step"] = flops * n
        if steps > 0 and seconds > 0:
            achieved = flops * steps / seconds / 1e12
            out["cost/tflops_per_s_per_device"] = achieved
            if peak:
                out["cost/utilisation"] = achieved / peak
    return out


def summarise(rows: Sequence[Mapping[str, Any]], *, peak: float | None) -> dict[str, float]:
    """The cost of several calls of one kind: total steps and time, their throughput and FLOPs
    (and utilisation of ``peak`` TFLOP/s per device; None: none)."""
    steps = sum(r["steps"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    flops = [r["flops"] for r in rows if r.get("flops") is not None]
    examples = sum(r["examples"] * r["steps"] for r in rows) / steps if steps else 0.0
    tokens = sum(r["tokens"] * r["steps"] for r in rows) / steps if steps else 0.0
    out = {"cost/timed_steps": float(steps), "cost/train_s": float(seconds)}
    mean_flops = float(np.mean(flops)) if flops else None
    out.update(_rates(steps, seconds, examples, tokens, mean_flops, peak))
    return out


def cost_table(rows: Sequence[Mapping[str, Any]], *, peak: float | None = None) -> str:
    """A Markdown "Cost" table of trainer rows, one row per label (``fit`` description or loss),
    with utilisation against ``peak`` TFLOP/s per device (None: none)."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["label"], []).append(r)
    lines = [
        "## Cost",
        "",
        f"{jax.device_count()} × {jax.devices()[0].device_kind} ({jax.default_backend()}); "
        + (f"peak {peak:g} TFLOP/s per device" if peak else "no peak TFLOP/s known")
        + "; compilation, evaluation and checkpoints excluded.",
        "",
        "| trainer | calls | timed steps | examples/s | tokens/s | FLOPs/step | TFLOP/s/device "
        "| utilisation |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: float | None, spec: str) -> str:
        return "" if value is None or not math.isfinite(value) else format(value, spec)

    for label, group in groups.items():
        s = summarise(group, peak=peak or 0.0)
        cells = [
            label.replace("|", "\\|"),
            str(len(group)),
            f"{int(s['cost/timed_steps']):,}",
            fmt(s.get("cost/examples_per_s"), ",.0f"),
            fmt(s.get("cost/tokens_per_s"), ",.0f"),
            fmt(s.get("cost/flops_per_step"), ".3e"),
            fmt(s.get("cost/tflops_per_s_per_device"), ".4g"),
            fmt(s.get("cost/utilisation"), ".2%"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    memory = peak_memory()
    lines += [""] + [f"- {k.split('/')[1]}: {v / 2**20:,.1f} MiB" for k, v in memory.items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# fit's meter, and the sweep trainers' timed calls.


class StepMeter:
    """The cost of one ``fit`` call, and its profiler trace (if the run asked for one).

    ``fit`` calls :meth:`compiled` once with the compiled step and a host batch,
    :meth:`profile` before every step, :meth:`log` at every logging step, :meth:`stop` once the
    steps have run and :meth:`summary` at the end.
    """

    def __init__(self, description: str, options: TrainOptions) -> None:
        self.description = description
        self.flops: float | None = None
        self.examples = self.tokens = 0
        self._mark = (0, 0.0)  # (timed steps, train seconds) at the previous log
        self._options = options
        self._tracing = False
        self._stop_after = 0

    def compiled(self, compiled: Any, host_batch: Any) -> None:
        self.flops = compiled_flops(compiled)
        self.examples, self.tokens = batch_size_of(host_batch)

    def profile(self, step: int, state: Any) -> float:
        """Starts the run's trace before step ``profile.start_step``, or stops it (once ``state``,
        the last traced step's, is ready) before the step after the traced ones.

        Returns:
          The seconds this took (0 on the other steps), which are not a training step's time.
        """
        o = self._options
        begin = time.perf_counter()
        if self._tracing and step > self._stop_after:
            self.stop(state)
        elif o.profile_steps and not o.log.profiled and o.profile_dir and step == o.profile_start:
            o.log.profiled = self._tracing = True
            self._stop_after = step + o.profile_steps - 1
            logging.info("Profiling steps %d-%d into %s", step, self._stop_after, o.profile_dir)
            jax.profiler.start_trace(o.profile_dir)
        else:
            return 0.0
        return time.perf_counter() - begin

    def stop(self, state: Any = None) -> None:
        """Ends the trace (if one is running), once ``state`` (if given) is ready."""
        if self._tracing:
            self._tracing = False
            if state is not None:
                jax.block_until_ready(state)
            jax.profiler.stop_trace()

    def log(self, timed_steps: int, train_s: float) -> dict[str, float]:
        """The ``cost/*`` scalars of the interval since the previous call."""
        steps, seconds = timed_steps - self._mark[0], train_s - self._mark[1]
        self._mark = (timed_steps, train_s)
        rates = _rates(
            steps, seconds, self.examples, self.tokens, self.flops, self._options.peak_tflops
        )
        return {**rates, **peak_memory()}

    def summary(self, timed_steps: int, train_s: float) -> dict[str, float]:
        """The cost of this process's steps; also recorded in the run's cost table."""
        row = {
            "label": self.description,
            "steps": timed_steps,
            "seconds": train_s,
            "examples": self.examples,
            "tokens": self.tokens,
            "flops": self.flops,
        }
        if timed_steps or self.flops is not None:
            _record(self._options, row)
        return {**summarise([row], peak=self._options.peak_tflops), **peak_memory()}


# Compiled sweep programs' FLOPs, by (function, argument shapes and static arguments).
_FLOPS: dict[Any, float | None] = {}


def _signature(args: Any) -> Any:
    """Tree structure, shapes and dtypes of the arrays, and the other leaves themselves (static
    arguments: functions, optimizers, flags)."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(
        (np.shape(x), str(x.dtype)) if hasattr(x, "dtype") and hasattr(x, "shape") else x
        for x in leaves
    )


def program_flops(jitted: Callable[..., Any], *args: Any, **kwargs: Any) -> float | None:
    """:func:`compiled_flops` of ``jitted.lower(*args, **kwargs).compile()``, once per signature.

    The call that follows with the same arguments reuses that compilation (jit's cache), so the
    compilation is not part of its time.
    """
    key = (jitted, _signature((args, kwargs)))
    try:
        return _FLOPS[key]
    except KeyError:
        flops = _FLOPS[key] = compiled_flops(jitted.lower(*args, **kwargs).compile())
        return flops
    except TypeError:  # an unhashable static argument (jit refuses it too)
        return None


def record_steps(
    label: str,
    *,
    options: TrainOptions,
    steps: int,
    seconds: float,
    examples: float,
    tokens: float = 0,
    flops: float | None = None,
) -> None:
    """Adds ``steps`` training steps (``examples`` examples and ``tokens`` tokens each, ``flops``
    per step on one device) that took ``seconds`` to the run's cost rows (``options.log``: the
    run's cost table, and the metrics of the sweep cell being computed)."""
    _record(
        options,
        {
            "label": label,
            "steps": steps,
            "seconds": seconds,
            "examples": examples,
            "tokens": tokens,
            "flops": flops,
        },
    )


def timed_call(
    jitted: Callable[..., Any],
    *args: Any,
    options: TrainOptions,
    label: str,
    steps: int,
    examples: int,
    tokens: int = 0,
    **kwargs: Any,
) -> Any:
    """``jitted(*args, **kwargs)``, compiled beforehand (not timed), then timed to its end.

    Records ``steps`` training steps of ``examples`` examples (and ``tokens`` tokens) each, with
    the compiled program's FLOPs, in ``options.log`` (:func:`record_steps`). Blocks until the
    result is ready (once per call: a sweep trainer's call is many steps).
    """
    flops = program_flops(jitted, *args, **kwargs)
    start = time.perf_counter()
    out = jax.block_until_ready(jitted(*args, **kwargs))
    seconds = time.perf_counter() - start
    record_steps(
        label,
        options=options,
        steps=steps,
        seconds=seconds,
        examples=examples,
        tokens=tokens,
        flops=flops,
    )
    return out
