"""Stop signals: Ctrl-C, a scheduler's SIGTERM and SIGUSR1 all end a run the same way.

Preemptible TPU VMs and spot GPUs, Slurm (``scancel``, the time limit, ``--signal=USR1@...``),
Kubernetes and ``timeout`` stop a job with SIGTERM (or SIGUSR1) and kill it a grace period later.
Each of these signals is treated as Ctrl-C is:

* **inside** :func:`~experiments.common.loop.fit` (:class:`StopFlag`): the first signal lets the
  current step finish; ``fit`` saves a checkpoint at that step, logs one line naming the signal
  and how to resume, and returns with ``interrupted=True``; a second signal aborts at once. In a
  multi-process job every process must save the *same* step, so there SIGINT and SIGUSR1 are
  turned into SIGTERM, which JAX's preemption service owns: it tells every process and agrees
  on a step (``multihost_utils.reached_preemption_sync_point``, asked by ``fit`` every step), at
  which all of them save their shards and stop;
* **outside** it (:func:`raise_on_stop_signals`, installed by ``python -m experiments.train``
  for the whole run): the signal raises :class:`Stopped`, a ``KeyboardInterrupt``, so ``with``
  blocks close (the workdir lock is released) and finished work stays (checkpoints, the cells of
  a sweep); the runner prints one line and exits with ``128 + signal number`` (130 for SIGINT,
  143 for SIGTERM), as a shell reports a process stopped by that signal. It exits at once
  (:func:`exit_at_once`), without waiting for a jitted computation still in flight.
"""

from __future__ import annotations

import contextlib
import logging as stdlib_logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

from absl import logging

__all__ = [
    "STOP_SIGNALS",
    "StopFlag",
    "Stopped",
    "describe",
    "exit_at_once",
    "exit_code",
    "last_stop_signal",
    "raise_on_stop_signals",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# The signal that stopped this process's latest interrupted fit (signals are process-wide): one
# slot, replaced by each stop.
_last_stop: list[int] = []


class Stopped(KeyboardInterrupt):
    """A stop signal arrived where no training step could finish first (or it came twice)."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)


def exit_code(signum: int) -> int:
    """``128 + signum``: the status a shell reports for a process stopped by ``signum``."""
    return 128 + int(signum)


def exit_at_once(code: int, *, multiprocess: bool = False) -> NoReturn:
    """Ends the process with status ``code`` after a stop signal, not waiting for XLA work.

    A stop outside ``fit`` can leave a jitted computation running (a fine-tune's long
    ``lax.scan``, dispatched asynchronously): its result is not wanted, but a normal exit waits for
    it (JAX's exit hook clears the backends, which blocks on pending work), possibly past a
    scheduler's grace period. What must be kept is already on disk by then: the ``with`` blocks
    (workdir lock, checkpoint managers, metric writers) closed as the stop propagated. So this
    flushes the log handlers and output streams and leaves without the exit hooks.

    Args:
      code: the exit status (:func:`exit_code`).
      multiprocess: the job has several processes: exits normally (``sys.exit``), so that
        ``jax.distributed`` shuts down and the other processes are told.
    """
    if multiprocess:
        sys.exit(code)
    stdlib_logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def describe(signum: int | None) -> str:
    """``"SIGTERM"`` for a signal number; for None (a multi-process job's preemption notice, which
    JAX's preemption service received) ``"SIGTERM (a preemption notice to the job)"``."""
    return (
        "SIGTERM (a preemption notice to the job)"
        if signum is None
        else signal.Signals(signum).name
    )


def last_stop_signal() -> int | None:
    """The signal that stopped this process's latest interrupted ``fit``, or None."""
    return _last_stop[-1] if _last_stop else None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def raise_on_stop_signals() -> Iterator[None]:
    """While the block runs (main thread), every stop signal raises :class:`Stopped`."""
    if not _in_main_thread():
        yield
        return

    def handler(signum, frame):
        del frame
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class StopFlag:
    """While active (main thread): the first stop signal sets :attr:`signum`; a second raises.

    Args:
      multiprocess: the job has several processes. Then SIGTERM is left to JAX's preemption
        service (its handler is installed by ``jax.distributed.initialize``), and SIGINT and
        SIGUSR1 are re-sent to this process as SIGTERM, so that every process of the job saves the
        same step; ``fit`` asks ``CheckpointManager.reached_preemption(step)`` every step.
    """

    def __init__(self, *, multiprocess: bool = False) -> None:
        self.signum: int | None = None
        self.multiprocess = multiprocess
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame):
        del frame
        if self.signum is not None:
            raise Stopped(signum)
        self.signum = signum
        name = signal.Signals(signum).name
        logging.warning("%s: finishing this step and saving a checkpoint (again to abort).", name)
        if self.multiprocess:
            os.kill(os.getpid(), signal.SIGTERM)  # to the preemption service: every process stops

    def stopped(self, signum: int | None) -> None:
        """Records that ``signum`` (None: a preemption notice) stopped the run."""
        _last_stop[:] = [signal.SIGTERM if signum is None else signum]

    def __enter__(self) -> StopFlag:
        if _in_main_thread():
            own = STOP_SIGNALS
            if self.multiprocess:
                own = tuple(s for s in STOP_SIGNALS if s != signal.SIGTERM)
            self._previous = {s: signal.signal(s, self._handler) for s in own}
        return self

    def __exit__(self, *exc) -> bool:
        for s, h in self._previous.items():
            signal.signal(s, h)
        return False
