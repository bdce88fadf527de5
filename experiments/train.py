r"""The one entry point: ``python -m experiments.train --config=configs/<name>.py[:arg]``.

Examples::

    python -m experiments.train --config=configs/lora_finetune.py
    python -m experiments.train --config=configs/lora_finetune.py:smoke,method=full \
        --config.optim.learning_rate=3e-4 --workdir=/tmp/full

``config.experiment`` names the module ``experiments/<experiment>.py``; its
``check_config(config)`` (if any) validates the config before anything is computed and its
``run(config, workdir, options)`` trains and returns the final metrics. ``options`` is the run's
:class:`~experiments.common.options.TrainOptions`, built from the config as ``run`` itself builds
it when called without (a notebook), plus what only the runner does: ``config.json`` written once
the first trainer has built its state, and the cost table appended to ``results.md``.
``--workdir`` defaults to
``runs/<config-name>[_<arg>]``; rerunning the same command resumes from the latest checkpoint
there. Ctrl-C, SIGTERM and SIGUSR1 (a scheduler's preemption notice) save a checkpoint of the
current step, print one line saying so, release the workdir and exit with ``128 + signal``
(130, 143, 138); see :mod:`experiments.common.signals`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging as stdlib_logging
import os
import re
import signal
import sys
from contextlib import nullcontext
from typing import Any

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from experiments.common import (
    checkpoint,
    config_checks,
    cost,
    metrics,
    sharding,
    signals,
    steps,
    supervisor,
)
from experiments.common import workdir as workdir_lock
from experiments.common.options import TrainOptions

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Config file, e.g. configs/lora_finetune.py or configs/lora_finetune.py:smoke.",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (default: runs/<config-name>[_<arg>]); reruns resume from it."
)
flags.mark_flags_as_required(["config"])


def default_workdir(config_arg: str) -> str:
    """``runs/<config file stem>[_<arg>]``, e.g. ``runs/lora_finetune_smoke_method=full``."""
    path, _, arg = config_arg.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    suffix = re.sub(r"[^A-Za-z0-9=.+-]+", "_", arg).strip("_")
    return os.path.join("runs", f"{name}_{suffix}" if suffix else name)


CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def available_configs() -> list[tuple[str, str]]:
    """``(path, options)`` of every runnable config in ``configs/``; options as ``parse_arg`` says.

    A config's ``:arg`` options are read by asking its ``get_config`` for an unknown option: the
    ``ConfigError`` lists the allowed ones with their defaults.
    """
    import configs.common

    out = []
    for name in sorted(os.listdir(CONFIGS_DIR)):
        stem, ext = os.path.splitext(name)
        if ext != ".py" or stem in ("__init__", "common") or stem.endswith("_base"):
            continue
        module = importlib.import_module(f"configs.{stem}")
        if not hasattr(module, "get_config"):
            continue
        try:
            module.get_config("__list_options__")
            options = ""
        except configs.common.ConfigError as e:
            options = str(e).partition("allowed are ")[2]
        out.append((os.path.join("configs", name), options))
    return out


def _configs_help() -> str:
    lines = ["", "Configs (--config=<path>[:<option>,<option>=<value>]; defaults shown):"]
    for path, options in available_configs():
        lines.append(f"  {path}" + (f"  [{options}]" if options else ""))
    return "\n".join(lines) + "\n"


def _config_arg(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _load_config_file(spec: str):
    """``get_config(arg)`` of the config file of ``--config=<path>[:<arg>]`` (may raise)."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_config_for_errors", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _explain_config_file_error(argv: list[str]) -> str | None:
    """The error that ``get_config`` raised for ``--config=<path>:<arg>``, in one line, or None."""
    spec = _config_arg(argv)
    if spec is None:
        return None
    try:
        _load_config_file(spec)
    except config_checks.ConfigError as e:  # an unknown or invalid :arg (configs.common)
        return f"--config={spec}: {e}"
    except Exception as e:  # noqa: BLE001 - any failure of the user's config file, in one line
        return f"--config={spec}: {type(e).__name__}: {e}"
    return None


def _explain_override_error(argv: list[str]) -> str | None:
    """Names the bad ``--config.<key>`` override and the keys that exist, or None."""
    spec = _config_arg(argv)
    if spec is None:
        return None
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        return f"--config={spec}: no such file {path!r}"
    config = _load_config_file(spec)
    for a in argv:
        if a.startswith("--config."):
            key = a[len("--config.") :].split("=", 1)[0]
            reason = config_checks.explain_unknown_key(config, key)
            if reason is not None:
                return f"--config.{key}: {reason}"
    return None


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with a clear message for ``--config.<key>`` overrides of missing keys."""
    if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
        sys.modules["__main__"].__doc__ = (sys.modules["__main__"].__doc__ or "") + _configs_help()
    spec = _config_arg(argv)
    if spec is not None and not os.path.isfile(spec.partition(":")[0]):
        listing = "\n".join(f"  {path}" for path, _ in available_configs())
        sys.exit(f"FATAL --config={spec}: no such file. Available configs:\n{listing}")
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        if "Error whilst parsing config file" in str(e):  # get_config raised (a bad :arg)
            reason = _explain_config_file_error(argv)
            if reason is not None and not os.environ.get("LOWRANK_JAX_TRACEBACK"):
                sys.exit(f"FATAL {reason} (LOWRANK_JAX_TRACEBACK=1 shows the traceback)")
        sys.exit(
            f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags."
        )
    except (AttributeError, KeyError) as e:
        reason = _explain_override_error(argv) or str(e)
        sys.exit(f"FATAL Invalid config override: {reason}")


def load_experiment(config):
    """Imports ``experiments.<config.experiment>`` and checks ``config`` with its ``check_config``.

    Raises:
      config_checks.ConfigError: if the module does not exist or the config is invalid.
    """
    name = config_checks.get_path(config, "experiment")
    here = os.path.dirname(os.path.abspath(__file__))
    available = sorted(
        f[:-3]
        for f in os.listdir(here)
        if f.endswith(".py") and f not in ("__init__.py", "train.py")
    )
    if name not in available:
        raise config_checks.ConfigError(
            f"config.experiment={name!r} is invalid: allowed values are {', '.join(available)}"
        )
    module = importlib.import_module(f"experiments.{name}")
    if hasattr(module, "check_config"):
        module.check_config(config)
    return module


# Sections that may change when a run is resumed: how it is logged, saved, laid out over devices,
# measured and profiled, and the loop's fault policy (a run stopped by a NaN may be resumed
# skipping such steps).
_FREE = ("log", "ckpt", "parallel", "train", "hardware", "profile")


def _has_checkpoint(workdir: str) -> bool:
    """Whether a ``checkpoints/<step>`` directory exists in ``workdir`` or 3 levels below it.

    (A continual run keeps one per task: ``<workdir>/<method>/seed_<s>/task_<t>/checkpoints``.)
    """
    for root, dirs, _ in os.walk(workdir):
        steps = os.listdir(os.path.join(root, "checkpoints")) if "checkpoints" in dirs else ()
        if any(d.isdigit() for d in steps):
            return True
        if root.count(os.sep) - workdir.count(os.sep) >= 3:
            dirs[:] = []
    return False


def _extends(old: Any, new: Any) -> bool:
    """Whether the list ``new`` is the list ``old`` with entries appended."""
    return isinstance(old, list) and isinstance(new, list) and new[: len(old)] == old


def _check_workdir(workdir: str, config, growable: tuple[str, ...] = ()) -> None:
    """Refuses to resume a workdir that holds a run of a different config.

    Differences in the ``log``, ``ckpt``, ``parallel``, ``train``, ``hardware`` and ``profile``
    sections are allowed: they change how a run is logged, saved, laid out over devices, measured
    and profiled, and whether it stops or skips a non-finite step, not what it computes otherwise. So are the top-level keys in ``growable``
    (an experiment's ``GROWABLE``, e.g. the continual ``seeds`` and ``methods``) when the new value
    only appends entries to the old one: the finished runs stay valid and the new ones are added.
    A workdir without any checkpoint holds nothing to resume (e.g. a run that failed while
    starting), so its ``config.json`` is simply replaced.
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path) or not _has_checkpoint(workdir):
        return
    with open(path) as f:
        old = json.load(f)
    new = json.loads(json.dumps(config.to_dict(), default=str))
    # Logging, checkpoints, device layout and the NaN policy may change between runs, and the
    # growable keys grow; nothing else.
    diff = [
        k
        for k in config_checks.config_differences(old, new)
        if k.split(".")[0] not in _FREE and not (k in growable and _extends(old.get(k), new.get(k)))
    ]
    if diff:
        grow = [k for k in diff if k in growable]
        hint = f" ({', '.join(grow)} may only grow by appending entries)" if grow else ""
        raise config_checks.ConfigError(
            f"{workdir} holds a run of a different config (keys {', '.join(diff)} differ{hint}), "
            "so it cannot be resumed: pass another --workdir or delete that directory"
        )


class _QuietLibraries(stdlib_logging.Filter):
    """Drops INFO records of orbax (a dozen lines per checkpoint) so the progress bar stays legible."""

    def filter(self, record: stdlib_logging.LogRecord) -> bool:
        return record.levelno >= stdlib_logging.WARNING or "/orbax/" not in record.pathname


# Errors a user can act on: reported in one line (set LOWRANK_JAX_TRACEBACK=1 for the traceback).
_USER_ERRORS = (
    config_checks.ConfigError,
    steps.NonFiniteError,
    checkpoint.CheckpointError,
    ValueError,
    OSError,
)


def _run(config, workdir: str) -> dict:
    module = load_experiment(config)
    sharding.initialize_distributed(config)
    lock = workdir_lock.lock_workdir(workdir) if jax.process_index() == 0 else nullcontext()
    with lock:
        _check_workdir(workdir, config, getattr(module, "GROWABLE", ()))
        logging.info("Experiment %s, workdir %s", config.experiment, workdir)

        # config.json once the model and adapters are built (a failed start leaves none behind)
        def write_config() -> None:
            metrics.write_config_json(workdir, config)

        # config.train, config.hardware and config.profile: every trainer of the run gets them
        options = TrainOptions.from_config(config, workdir, on_start=write_config)
        result = module.run(config, workdir, options)
        options.log.started()  # an experiment that neither calls fit nor sweeps cells
        cost.append_cost_table(workdir, options)
        return result


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_QuietLibraries())
    config = _CONFIG.value
    workdir = _WORKDIR.value
    if workdir is None:
        workdir = default_workdir(flags.FLAGS["config"].config_filename)
    parallel = config.get("parallel", None)
    multiprocess = parallel is not None and parallel.get("distributed", False)
    if multiprocess:
        # JAX aborts from C++ when a peer dies: a parent process turns that into one line.
        supervisor.watch_peers(workdir)
    try:
        with signals.raise_on_stop_signals():
            result = _run(config, workdir)
    except KeyboardInterrupt as e:  # a stop signal where no training step could save first
        signum = e.signum if isinstance(e, signals.Stopped) else signal.SIGINT
        print(
            f"Stopped by {signals.describe(signum)}; what finished is kept in {workdir} "
            "(checkpoints, finished cells). Rerun the same command to resume.",
            file=sys.stderr,
        )
        signals.exit_at_once(signals.exit_code(signum), multiprocess=multiprocess)
    except config_checks.ConfigError as e:
        sys.exit(f"FATAL Invalid config: {e}")
    except _USER_ERRORS as e:
        if os.environ.get("LOWRANK_JAX_TRACEBACK"):
            raise
        sys.exit(f"FATAL {type(e).__name__}: {e} (LOWRANK_JAX_TRACEBACK=1 shows the traceback)")
    except jax.errors.JaxRuntimeError as e:  # a multi-process collective that failed
        message = supervisor.collective_failure_message(e, workdir=workdir)
        if message is None or os.environ.get("LOWRANK_JAX_TRACEBACK"):
            raise
        sys.exit(message)
    skipped = metrics.skipped_steps_under(workdir) if jax.process_index() == 0 else 0
    if skipped:  # said in the final JSON, in results.md and in one line
        result = {**result, "skipped_steps": skipped}
        said = (
            f"{skipped} training steps were skipped (non-finite, or a loss above "
            "train.max_loss) and kept the previous state (train.skip_nonfinite); a final loss of "
            "null means the state kept is unusable too."
        )
        table = os.path.join(workdir, "results.md")
        if os.path.exists(table):
            with open(table, "a") as f:
                f.write(f"\n**Warning**: {said}\n")
        print(f"WARNING {said}", file=sys.stderr)
    print(json.dumps(metrics.json_safe({"workdir": workdir, **result}), indent=2, default=str))
    if result.get("interrupted"):  # fit logged the signal, the step saved and how to resume
        sys.exit(signals.exit_code(signals.last_stop_signal() or signal.SIGINT))


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
