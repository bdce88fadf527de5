"""Timing and memory helpers shared by the benchmarks in ``experiments/bench``.

* :func:`run_rounds` times several methods interleaved in rounds (the order rotates every round),
  so that noise from other jobs on a shared machine hits every method alike, and samples each
  method's peak resident memory while it runs (:class:`PeakRSS`).
* :func:`compile_stats` reads XLA's memory analysis, FLOP count and HLO text of a compiled step;
  :func:`weight_shaped_dots` finds the matmuls in that HLO whose result has a weight's shape and
  which contract over many rows (weight gradients, or ``W + ΔW`` formed from a wide product).
* :func:`tree_bytes`, :func:`markdown_table`, :func:`num_threads` are small utilities.

Example::

    stats = compile_stats(jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile())
    timings = run_rounds({"a": run_a, "b": run_b}, rounds=5, warmup=1)
    print(markdown_table(["method", "median s"], [[k, t.median] for k, t in timings.items()]))
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import math
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "CompileStats",
    "PeakRSS",
    "Timing",
    "compile_stats",
    "markdown_table",
    "num_threads",
    "rss_bytes",
    "run_rounds",
    "tree_bytes",
    "trim_malloc",
    "weight_shaped_dots",
]

MB = 1 << 20


def num_threads() -> int:
    """CPU cores this process may run on (what XLA's CPU thread pool is sized to)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rss_bytes() -> int:
    """Resident set size of this process in bytes (psutil if installed, else ``/proc``)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


_LIBC = None


def trim_malloc() -> None:
    """Returns freed heap memory to the OS (glibc ``malloc_trim``), so that RSS rises again
    only with what the next computation really touches. A no-op without glibc."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    if _LIBC and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


class PeakRSS:
    """Context manager that samples RSS in a thread: ``start``, ``peak`` (bytes) and ``rise``.

    ``rise = peak - start`` is the transient memory of what ran inside (activations, temporaries),
    on top of what was resident before (parameters, other methods' state, the compiled code).
    """

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        trim_malloc()
        self.start = self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def rise(self) -> int:
        return self.peak - self.start


@dataclasses.dataclass
class Timing:
    """Per-method results of :func:`run_rounds`: step times (s) and RSS (bytes) of timed rounds."""

    times: list[float] = dataclasses.field(default_factory=list)
    cpu_times: list[float] = dataclasses.field(default_factory=list)
    peak_rss: int = 0
    rss_rise: int = 0
    first_result: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    @property
    def cpu_median(self) -> float:
        """Median CPU seconds (all threads of the process) per step: less sensitive than wall
        time to other jobs on a shared machine, which delay a step without adding CPU time."""
        return statistics.median(self.cpu_times) if self.cpu_times else math.nan


def run_rounds(
    methods: Mapping[str, Callable[[], Any]], *, rounds: int, warmup: int = 1
) -> dict[str, Timing]:
    """Runs ``warmup + rounds`` rounds; in each, every method once (order rotated per round).

    Each callable runs one complete step and must block until it is done (call
    ``jax.block_until_ready`` inside). Warm-up rounds are not timed; RSS is sampled in timed
    rounds only. Wall and process CPU time are both recorded (CPU time includes the RSS
    sampler's, a few ms per second). ``first_result`` keeps what each method returned the first time it ran.

    Args:
      methods: ``{name: run_one_step}``.
      rounds: timed rounds (>= 1).
      warmup: untimed rounds first.

    Returns:
      ``{name: Timing}`` in the order of ``methods``.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got {rounds=}, {warmup=}.")
    names = list(methods)
    out = {name: Timing() for name in names}
    for i in range(warmup + rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            timed = i >= warmup
            with PeakRSS() as rss:
                t0, c0 = time.perf_counter(), time.process_time()
                result = methods[name]()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
            rec = out[name]
            if i == 0:
                rec.first_result = result
            if timed:
                rec.times.append(dt)
                rec.cpu_times.append(dc)
                rec.peak_rss = max(rec.peak_rss, rss.peak)
                rec.rss_rise = max(rec.rss_rise, rss.rise)
    return out


@dataclasses.dataclass
class CompileStats:
    """What XLA says about one compiled computation (bytes, FLOPs, optimised HLO text)."""

    temp: int
    argument: int
    output: int
    alias: int
    flops: float
    hlo: str

    @property
    def total(self) -> int:
        """``temp + argument + output`` (donated outputs that alias arguments count twice)."""
        return self.temp + self.argument + self.output


def compile_stats(compiled: Any) -> CompileStats:
    """Reads ``memory_analysis()``, ``cost_analysis()`` and ``as_text()`` of a compiled jit."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax returned one dict per computation
        cost = cost[0] if cost else {}
    return CompileStats(
        temp=int(mem.temp_size_in_bytes),
        argument=int(mem.argument_size_in_bytes),
        output=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes),
        flops=float((cost or {}).get("flops", math.nan)),
        hlo=compiled.as_text(),
    )


_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[a-z]+[0-9]*\[([0-9,]*)\]\S*\s+(\w[\w\-]*)\((.*)$"
)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def weight_shaped_dots(
    hlo: str, weight_shapes: Iterable[Sequence[int]], *, min_contraction: int = 64
) -> list[str]:
    """The ``dot`` instructions of an HLO text whose result has a weight's shape (or its
    transpose) and whose contraction is at least ``min_contraction`` long.

    In a training step those are weight gradients ``Xᵀ·dY`` (contracting over tokens); a
    factorised LoRA step should have none, while a rank-``r`` product ``A·B`` that forms ``ΔW``
    contracts over ``r`` only and is not counted when ``r < min_contraction``.

    Returns:
      One line per such dot: ``"(m, n) <- contract K"``.
    """
    shapes = {tuple(s) for s in weight_shapes} | {tuple(s)[::-1] for s in weight_shapes}
    array_shapes: dict[str, tuple[int, ...]] = {}
    dots = []
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, dims, op, rest = m.group(1), _dims(m.group(2)), m.group(3), m.group(4)
        array_shapes[name] = dims
        if op == "dot":
            dots.append((dims, rest))
    found = []
    for out, rest in dots:
        if out not in shapes:
            continue
        lhs = re.match(r"\s*(?:[a-z]+[0-9]*\[[0-9,]*\]\S*\s+)?%?([\w.\-]+)", rest)
        c = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
        if not (lhs and c) or lhs.group(1) not in array_shapes:
            found.append(f"{out} <- contract ?")
            continue
        lhs_shape = array_shapes[lhs.group(1)]
        k = math.prod(lhs_shape[i] for i in _dims(c.group(1)))
        if k >= min_contraction:
            found.append(f"{out} <- contract {k}")
    return found


def tree_bytes(tree: Any) -> int:
    """Bytes of all array leaves of a pytree (JAX, NumPy or anything with ``nbytes``)."""
    return sum(
        int(np.asarray(x).nbytes) if not hasattr(x, "nbytes") else int(x.nbytes)
        for x in jax.tree.leaves(tree)
    )


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are printed with 3 significant digits."""

    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "–"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
