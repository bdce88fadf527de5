"""``TrainOptions``: the run-wide options of every trainer, one explicit value per run.

A run's trainers (:func:`experiments.common.fit`, :func:`experiments.common.sweep.train_scan`,
:func:`~experiments.common.sweep.train_epochs` and the cells of a
:class:`~experiments.common.sweep.CellStore`) read these options from the value passed to them,
never from the environment. :meth:`TrainOptions.from_config` builds it from the config's
``train``, ``hardware`` and ``profile`` sections (``configs.common``), so code that calls an
experiment's ``run(config, workdir)`` (a notebook, a test) trains as ``python -m
experiments.train`` does: ``run`` builds the value from the config itself unless it is given
one::

    def run(config, workdir, options=None):
        options = common.TrainOptions.from_config(config, workdir) if options is None else options
        ...
        result = common.fit(state, frozen, train_step, batches, ..., options=options)

The runner passes its own value, built the same way, with ``on_start`` (write ``config.json``
once the first trainer has built its state) and, when ``run`` returns, appends the cost table of
``options.log.rows`` to ``results.md`` (:func:`experiments.common.cost.append_cost_table`).

The value itself is frozen; its :class:`RunLog` is what the trainers report back while the run
goes on (their cost rows, whether the profiler trace was taken, the pending ``on_start``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

__all__ = ["RunLog", "TrainOptions"]


@dataclasses.dataclass
class RunLog:
    """What a run's trainers report back while it runs (one per :class:`TrainOptions`).

    Attributes:
      rows: one cost row per trainer call (``fit``, ``train_scan``, ``train_epochs``): label,
        timed steps and seconds, examples and tokens per step, FLOPs per step.
      profiled: the run's profiler trace was taken (by the first ``fit`` that reached
        ``profile_start``).
      on_start: called once, by :meth:`started`.
    """

    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    profiled: bool = False
    on_start: Callable[[], None] | None = None

    def started(self) -> None:
        """A trainer has built its state (the model and its adapters exist): runs ``on_start``
        the first time, nothing afterwards."""
        fn, self.on_start = self.on_start, None
        if fn is not None:
            fn()


def _detected_peak() -> float | None:
    from experiments.common.cost import peak_tflops  # (cost imports this module)

    return peak_tflops()


def _section(config: Any, name: str) -> Any:
    get = getattr(config, "get", None)
    return get(name, None) if get is not None else None


def _int_option(section: Any, name: str, where: str, default: int) -> int:
    value = section.get(name, default) if section is not None else default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.{where}.{name}={value!r} is invalid: must be an integer >= 0")
    return value


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """The options of every trainer of a run (see the module docstring).

    Attributes:
      skip_nonfinite: ``fit`` keeps the previous state on a step whose metrics or new state are
        not finite (counted in ``train/skipped_steps``) instead of stopping
        (``config.train.skip_nonfinite``).
      max_loss: ``fit`` treats a step whose ``metrics["loss"]`` exceeds it as non-finite; 0: off
        (``config.train.max_loss``).
      peak_tflops: the peak dense TFLOP/s of one device that ``cost/utilisation`` is measured
        against (``config.hardware.peak_tflops``; by default detected from the first device's
        kind; None: unknown, no utilisation).
      profile_start, profile_steps: trace the training steps ``profile_start ..
        profile_start + profile_steps - 1`` of the run's first ``fit`` that reaches
        ``profile_start`` (``config.profile``; ``profile_steps = 0``: no trace).
      profile_dir: where the trace goes (``<workdir>/profile``; None: no trace).
      log: what the trainers report back (:class:`RunLog`); not an option, so not compared.
    """

    skip_nonfinite: bool = False
    max_loss: float = 0.0
    peak_tflops: float | None = dataclasses.field(default_factory=_detected_peak)
    profile_start: int = 0
    profile_steps: int = 0
    profile_dir: str | None = None
    log: RunLog = dataclasses.field(default_factory=RunLog, compare=False, repr=False)

    @classmethod
    def from_config(
        cls,
        config: Any,
        workdir: str | os.PathLike | None = None,
        *,
        on_start: Callable[[], None] | None = None,
    ) -> TrainOptions:
        """The options of ``config``'s ``train``, ``hardware`` and ``profile`` sections.

        A config without a section gets its defaults: stop on a non-finite step, no bound on the
        loss, the peak detected from the first device's kind, no trace.

        Args:
          config: the run's config (``ml_collections.ConfigDict``, or any mapping).
          workdir: the run directory (the trace goes to ``<workdir>/profile``; None: no trace).
          on_start: called once, when the first trainer has built its state.

        Raises:
          TypeError: ``config.train.skip_nonfinite`` is not a bool.
          ValueError: ``config.train.max_loss`` is not a number >= 0, the peak is not a
            positive number, or a profile step is negative (or ``start_step`` is 0 with a
            trace asked for).
        """
        train = _section(config, "train")
        skip = train.get("skip_nonfinite", False) if train is not None else False
        max_loss = train.get("max_loss", 0.0) if train is not None else 0.0
        if not isinstance(skip, bool):
            raise TypeError(
                f"config.train.skip_nonfinite={skip!r} is invalid: must be True or False"
            )
        if isinstance(max_loss, bool) or not isinstance(max_loss, int | float) or not max_loss >= 0:
            raise ValueError(
                f"config.train.max_loss={max_loss!r} is invalid: must be a number >= 0 (0: off)"
            )
        hardware, profile = _section(config, "hardware"), _section(config, "profile")
        peak = hardware.get("peak_tflops", None) if hardware is not None else None
        if peak is not None and (
            isinstance(peak, bool) or not isinstance(peak, int | float) or not peak > 0
        ):
            raise ValueError(
                f"config.hardware.peak_tflops={peak!r} is invalid: the peak dense TFLOP/s of one "
                "device (e.g. 275 for a TPU v4 chip), or None to detect it from the device kind"
            )
        start = _int_option(profile, "start_step", "profile", 0)
        steps = _int_option(profile, "num_steps", "profile", 0)
        if steps and start < 1:
            raise ValueError(
                f"config.profile.start_step={start} is invalid: the first traced step, >= 1 "
                "(step 1 includes compilation; a later one shows the steady state)"
            )
        return cls(
            skip_nonfinite=skip,
            max_loss=float(max_loss),
            peak_tflops=float(peak) if peak is not None else _detected_peak(),
            profile_start=start,
            profile_steps=steps,
            profile_dir=os.path.join(os.fspath(workdir), "profile")
            if workdir is not None
            else None,
            log=RunLog(on_start=on_start),
        )
