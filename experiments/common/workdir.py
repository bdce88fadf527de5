"""One run per workdir: a lock file that a second run on a live workdir cannot take.

``lock_workdir(workdir)`` creates ``<workdir>/.lock`` with ``O_EXCL`` (atomic on local and NFS v3+
file systems) holding the pid, host and start time of the run, and removes it when the run ends. A
second run on the same workdir is refused with a message naming the holder; a lock left by a run
that died on this host (its pid no longer exists) is detected as stale and taken over. Example::

    with lock_workdir("runs/saber"):
        run(config, "runs/saber")
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator

from absl import logging

__all__ = ["LOCK_FILE", "WorkdirError", "lock_workdir"]

LOCK_FILE = ".lock"


class WorkdirError(OSError):
    """The workdir cannot be used: empty, a file, read-only, or in use by another run."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_holder(path: str) -> dict:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _usable_dir(workdir: str) -> str:
    if not workdir:
        raise WorkdirError("the workdir is empty: pass a directory, e.g. --workdir=runs/<name>")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"workdir {workdir} is a file, not a directory: pass another --workdir")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise WorkdirError(f"cannot create workdir {workdir}: {e.strerror}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise WorkdirError(f"workdir {workdir} is not writable: pass another --workdir")
    return workdir


@contextlib.contextmanager
def lock_workdir(workdir: str | os.PathLike) -> Iterator[str]:
    """Holds ``<workdir>/.lock`` while the block runs (creates ``workdir`` if needed).

    Args:
      workdir: the run directory.

    Yields:
      The path of the lock file.

    Raises:
      WorkdirError: ``workdir`` is empty, a file, not writable, or locked by a live run (the
        message names its pid, host and start time, and the file to delete if that run is gone).
    """
    workdir = _usable_dir(os.fspath(workdir))
    path = os.path.join(workdir, LOCK_FILE)
    host = socket.gethostname()
    me = {"pid": os.getpid(), "host": host, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_holder(path)
            pid = holder.get("pid")
            if holder.get("host") == host and isinstance(pid, int) and not _pid_alive(pid):
                logging.warning("Taking over the stale lock %s of dead process %d.", path, pid)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            raise WorkdirError(
                f"workdir {workdir} is in use by another run (pid {pid} on "
                f"{holder.get('host', '?')}, started {holder.get('started', '?')}): wait for it "
                f"to finish or pass another --workdir; if that run is gone, delete {path}"
            ) from None
        except OSError as e:
            raise WorkdirError(f"cannot create the lock {path}: {e.strerror}") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    else:  # pragma: no cover - another run took the stale lock between our two attempts
        raise WorkdirError(f"workdir {workdir} was just locked by another run")
    try:
        yield path
    finally:
        if _read_holder(path).get("pid") == me["pid"]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
