"""A clear message when a peer of a multi-process run dies, instead of an abort from C++.

When one process of a ``jax.distributed`` job dies (SIGKILL, out of memory, a lost host), the
others do not get a Python exception: on CPU, gloo's next collective throws
``gloo::EnforceNotMet`` ("Received data size doesn't match expected size. Is there a distributed
collective mismatch in your code?") from an XLA thread, or the JAX coordination service reports
the missed heartbeats with ``LOG(FATAL)`` ("Terminating process because the JAX distributed
service detected fatal errors"). Both end in ``abort()``: nothing in the dying process can catch
them, and the last line a user sees names no dead peer.

:func:`watch_peers` therefore forks before JAX starts. The child returns and runs the training
as usual (its stdout is inherited; its stderr passes through the parent, which keeps the last
few kilobytes). The parent only waits; when the child dies by a signal (``abort()`` included),
the parent reads the errors above in its stderr and prints one line that says which process died
(when JAX named it) and how to resume, and exits with status 1; otherwise it exits with the
child's status (0, 130 after Ctrl-C, 143 after SIGTERM, 1 after a ``FATAL`` user error). Signals:
Ctrl-C reaches both (the child saves a checkpoint and exits 130; the parent ignores it); SIGTERM,
SIGUSR1 and SIGHUP sent to the parent are passed on to the child (see
:mod:`~experiments.common.signals` for how it stops); on Linux the child is killed when the parent is (``PR_SET_PDEATHSIG``),
so killing the command a user started kills its training too. Example (what
``python -m experiments.train`` does when ``config.parallel.distributed`` is true)::

    watch_peers(workdir)          # returns in the child only
    jax.distributed.initialize()
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading

__all__ = ["collective_failure_message", "peer_failure_message", "watch_peers"]

_TAIL_BYTES = 16384
_PR_SET_PDEATHSIG = 1
# (regex over the child's stderr tail, what it means)
_GLOO = re.compile(r"gloo::\w+|Gloo|collective mismatch|Connection (?:reset|closed) by peer")
_COORDINATION = re.compile(r"JAX distributed service detected fatal errors|CoordinationService")
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*(.*?)\s*The tasks", re.S)


def _who() -> tuple[str, str]:
    """``("process 0 of 2", "2")`` from the JAX_* environment (``("this process", "")`` if unset)."""
    pid, num = os.environ.get("JAX_PROCESS_ID"), os.environ.get("JAX_NUM_PROCESSES")
    if pid is not None and num is not None:
        return f"process {pid} of {num}", num
    return "this process", ""


def peer_failure_message(tail: str, exit_code: int, *, workdir: str) -> str | None:
    """The one-line message for a child that ended with ``exit_code`` and stderr ``tail``.

    Args:
      tail: the last few kilobytes of the training process's stderr.
      exit_code: its exit status (negative: killed by that signal).
      workdir: the run directory (the message says where the checkpoints are).

    Returns:
      ``"FATAL process 0 of 2 stopped because process 1 died ..."`` and how to resume, or None
      when the child exited by itself (a status >= 0: its own output says why). JAX's
      heartbeat failure and gloo's broken collective both end in ``abort()`` (status -6).
    """
    if exit_code >= 0:  # it exited by itself: finished, Ctrl-C (130), or its own FATAL line
        return None
    me, num = _who()
    unhealthy = _UNHEALTHY.search(tail)
    if unhealthy:
        names = unhealthy.group(1)  # "1", or "/job:jax_worker/replica:0/task:1", one a line
        pattern = r"task:(\d+)" if "task:" in names else r"(\d+)"
        ids = sorted({int(i) for i in re.findall(pattern, names)})
        dead = ", ".join(str(i) for i in ids) or "?"
        cause = (
            f"process {dead} died (it stopped sending heartbeats to the JAX coordinator)"
            if len(ids) <= 1
            else f"processes {dead} died (they stopped sending heartbeats to the JAX coordinator)"
        )
    elif _GLOO.search(tail):
        match = _GLOO.search(tail)
        line = tail[: match.end()].rsplit("\n", 1)[-1] + tail[match.end() :].split("\n", 1)[0]
        cause = (
            "another process of the job died (the connection of a gloo collective broke: "
            f"{line.strip()[:160]!r})"
        )
    elif _COORDINATION.search(tail):
        cause = (
            "another process of the job died or the JAX coordinator (process 0) became "
            "unreachable (the JAX distributed service reported a fatal error)"
        )
    else:
        name = signal.Signals(-exit_code).name if -exit_code in signal.valid_signals() else ""
        cause = (
            f"its training process was killed by {name or f'signal {-exit_code}'}"
            + (" (out of memory?)" if name == "SIGKILL" else "")
            + "; the other processes of the job stop too"
        )
    return _fatal(me, num, cause, workdir)


def _fatal(me: str, num: str, cause: str, workdir: str) -> str:
    every = f"all {num} processes" if num else "every process of the job"
    return (
        f"FATAL {me} stopped because {cause}. Rerun the same command in {every} to resume from "
        f"the last checkpoint in {workdir}."
    )


def collective_failure_message(error: BaseException, *, workdir: str) -> str | None:
    """One line for a gloo failure raised as a Python exception in this process, or None.

    Gloo gives up when a peer does not join a collective within about 30 s ("Gloo context
    initialization failed: ... Connect timeout"): the peer died, or it reached that step much
    later (e.g. it compiled far slower on a loaded machine).
    """
    text = str(error).strip()
    if not _GLOO.search(text):
        return None
    me, num = _who()
    cause = (
        f"a collective with the other processes failed ({text.splitlines()[0][:160]!r}): a peer "
        "died, or reached that step more than gloo's ~30 s later (e.g. it compiled much slower "
        "on a loaded machine)"
    )
    return _fatal(me, num, cause, workdir)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when ``parent`` dies (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _pump(fd: int, tail: bytearray) -> None:
    """Copies ``fd`` to this process's stderr until EOF, keeping the last bytes in ``tail``."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    while chunk := os.read(fd, 65536):
        if out is not None:
            out.write(chunk)
            out.flush()
        tail.extend(chunk)
        del tail[:-_TAIL_BYTES]
    os.close(fd)


def watch_peers(workdir: str) -> None:
    """Forks; returns in the child (which trains), and exits in the parent when the child ends.

    Call it before any JAX computation and before ``jax.distributed.initialize`` (the fork copies
    a process without threads). Where ``os.fork`` does not exist it returns at once.

    Args:
      workdir: the run directory, named in the message.
    """
    if not hasattr(os, "fork"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        _die_with_parent(parent)
        return
    os.close(write_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child directly
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    tail = bytearray()
    pump = threading.Thread(target=_pump, args=(read_fd, tail), daemon=True)
    pump.start()
    _, status = os.waitpid(child, 0)
    pump.join(timeout=10)  # EOF once the child (and anything it started) has exited
    code = os.waitstatus_to_exitcode(status)
    message = peer_failure_message(tail.decode(errors="replace"), code, workdir=workdir)
    if message is not None:
        sys.stderr.write(message + "\n")
        code = 1
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code if code >= 0 else 1)
