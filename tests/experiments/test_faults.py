"""Numerical faults and workdirs that cannot be corrupted: each message a user sees, asserted.

In-process tests of ``fit``, ``restore_latest`` and ``lock_workdir`` on a toy problem, plus CLI
runs of the smallest real config (``configs/digits_mlp.py:smoke``).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import digits_mlp
from experiments import common, train
from experiments.common import signals
from tests.experiments.test_train_cli import REPO, SMOKE, final_metrics, run_cli


class Batches:
    """A resumable iterator of scalar batches; ``bad_step`` yields an Inf (a poisoned batch)."""

    def __init__(self, bad_step: int | None = None, bad_value: float = np.inf):
        self.i, self.bad_step, self.bad_value = 0, bad_step, bad_value

    def __next__(self):
        self.i += 1
        value = self.bad_value if self.i == self.bad_step else 1.0
        return {"x": np.full((2,), value, np.float32)}

    def state(self):
        return {"i": self.i}

    def restore(self, state):
        self.i = state["i"]


TX = optax.sgd(0.1)


def step_fn(state, frozen, batch, key):
    del frozen, key
    loss_fn = lambda w: jnp.mean((w * batch["x"] - 2.0) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state["w"])
    updates, opt_state = TX.update(grads, state["opt_state"])
    return {**state, "w": optax.apply_updates(state["w"], updates), "opt_state": opt_state}, {
        "loss": loss
    }


def _state():
    w = jnp.zeros(())
    return {"w": w, "opt_state": TX.init(w), "step": jnp.zeros((), jnp.int32)}


def _fit(workdir, batches, *, skip_nonfinite=False, max_loss=0.0, **kw):
    kw = {"num_steps": 10, "log_every": 1, "ckpt_every": 5, "progress": False, **kw}
    kw.setdefault("options", common.TrainOptions(skip_nonfinite=skip_nonfinite, max_loss=max_loss))
    return common.fit(
        _state(), None, step_fn, batches, key=jax.random.key(0), workdir=workdir, **kw
    )


class SignalAt(Batches):
    """Sends this process ``signums`` while fetching the batch of step ``step``."""

    def __init__(self, step: int, *signums: int):
        super().__init__()
        self.step, self.signums = step, signums

    def __next__(self):
        batch = super().__next__()
        if self.i == self.step:
            for signum in self.signums:
                os.kill(os.getpid(), signum)
        return batch


needs_main_thread = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signal handlers can only be installed from the main thread",
)


@needs_main_thread
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_saves_the_current_step_and_the_rerun_ends_as_an_uninterrupted_run(
    tmp_path, signum
):
    before = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    stopped = _fit(tmp_path / "run", SignalAt(7, signum))
    assert stopped.interrupted and int(stopped.state["step"]) == 7
    assert signals.last_stop_signal() == signum
    assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before  # restored
    manager = common.make_manager(tmp_path / "run" / "checkpoints", every=5)
    assert manager.all_steps() == [5, 7]  # the periodic one and the step it stopped at
    resumed = _fit(tmp_path / "run", Batches())
    reference = _fit(tmp_path / "reference", Batches())
    assert not resumed.interrupted and resumed.start_step == 7
    np.testing.assert_array_equal(resumed.state["w"], reference.state["w"])
    measured = lambda history: [
        {k: v for k, v in r.items() if not k.startswith("cost/")} for r in history
    ]  # noqa: E731
    assert measured(resumed.history) == measured(reference.history)  # cost/* are measurements


@needs_main_thread
def test_a_second_stop_signal_aborts_at_once(tmp_path):
    with pytest.raises(signals.Stopped) as err:
        _fit(tmp_path, SignalAt(3, signal.SIGTERM, signal.SIGTERM))
    assert err.value.signum == signal.SIGTERM and isinstance(err.value, KeyboardInterrupt)


@needs_main_thread
@pytest.mark.parametrize("signum", signals.STOP_SIGNALS)
def test_outside_fit_a_stop_signal_raises_stopped(signum):
    before = signal.getsignal(signum)
    with pytest.raises(signals.Stopped) as err, signals.raise_on_stop_signals():
        os.kill(os.getpid(), signum)
    assert err.value.signum == signum and signals.exit_code(signum) == 128 + signum
    assert signal.getsignal(signum) == before


# A jitted loop that never ends is dispatched (asynchronously), then the process exits as the
# runner does after a stop signal outside fit. A normal exit would wait for the loop forever.
_EXIT_WITH_A_COMPUTATION_IN_FLIGHT = """
import jax, jax.numpy as jnp
from experiments.common import signals
body = lambda c: (jnp.tanh(c[0] @ c[0]), c[1])  # a matmul: XLA dispatches it asynchronously
forever = jax.jit(lambda x, stop: jax.lax.while_loop(lambda c: c[1] == 0, body, (x, stop))[0])
forever(jnp.eye(64), jnp.int32(1)).block_until_ready()  # compiles; ends at once
running = forever(jnp.eye(64), jnp.int32(0))
print("dispatched", flush=True)
signals.exit_at_once(143)
"""


def test_exit_at_once_does_not_wait_for_a_computation_in_flight():
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_COMPUTATION_IN_FLIGHT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,  # killed (and failed) if the exit waited for the loop
    )
    assert proc.returncode == 143 and proc.stdout == "dispatched\n", proc.stderr[-2000:]


def test_nonfinite_loss_stops_naming_step_metric_and_last_good_checkpoint(tmp_path):
    with pytest.raises(common.NonFiniteError) as err:
        _fit(tmp_path, Batches(bad_step=7))
    assert str(err.value).startswith("train/loss=inf at step 7: training stopped; the last good")
    assert "step 5, is kept in" in str(err.value)
    manager = common.make_manager(tmp_path / "checkpoints", every=5)
    assert manager.all_steps() == [5]  # nothing non-finite was saved
    state, _ = common.restore_latest(manager, _state())
    assert np.isfinite(state["w"]) and int(state["step"]) == 5
    # Without a checkpoint before the fault, the message says so.
    with pytest.raises(common.NonFiniteError, match="at step 2: .*no checkpoint was saved"):
        _fit(tmp_path / "early", Batches(bad_step=2))


def test_nonfinite_step_is_not_evaluated(tmp_path):
    evaluated = []

    def eval_fn(state, frozen):
        evaluated.append(float(state["w"]))
        return {"valid/w": state["w"]}

    with pytest.raises(common.NonFiniteError, match="at step 7"):
        _fit(tmp_path, Batches(bad_step=7), log_every=5, eval_fn=eval_fn, eval_every=1)
    assert len(evaluated) == 6 and all(np.isfinite(evaluated))


def test_skip_nonfinite_keeps_the_previous_state_and_counts_skips(tmp_path):
    result = _fit(tmp_path, Batches(bad_step=7), skip_nonfinite=True)
    clean = _fit(tmp_path / "clean", Batches(), num_steps=9)
    # Step 7 changed nothing, so 10 steps with one skipped equal 9 clean steps.
    np.testing.assert_allclose(result.state["w"], clean.state["w"], rtol=1e-6)
    skipped = {r["step"]: r.get("train/skipped_steps", 0) for r in result.history}
    assert skipped[7] == 1 and sum(skipped.values()) == 1


def test_a_loss_above_max_loss_stops_like_a_nan_or_is_skipped(tmp_path):
    # A finite divergence: a batch of 1e3 gives a loss of ~1e6, finite, so only max_loss sees it.
    with pytest.raises(common.NonFiniteError) as err:
        _fit(tmp_path / "stop", Batches(bad_step=7, bad_value=1e3), max_loss=100.0)
    assert re.match(r"train/loss=2\.\d+e\+06 > train\.max_loss=100 at step 7: ", str(err.value))
    result = _fit(
        tmp_path / "skip", Batches(bad_step=7, bad_value=1e3), max_loss=100.0, skip_nonfinite=True
    )
    assert result.skipped_steps == 1 and np.isfinite(result.state["w"])
    # Off by default (0): the same run trains through the spike.
    assert _fit(tmp_path / "off", Batches(bad_step=7, bad_value=1e3)).skipped_steps == 0
    bad = ml_collections.ConfigDict({"train": {"skip_nonfinite": False, "max_loss": -1.0}})
    with pytest.raises(ValueError, match="config.train.max_loss=-1.0 is invalid"):
        common.TrainOptions.from_config(bad)


def test_config_train_skip_nonfinite_reaches_fit_through_its_options(tmp_path):
    config = digits_mlp.get_config("smoke")
    assert config.train.skip_nonfinite is False  # opt-in
    config.train.skip_nonfinite = True
    options = common.TrainOptions.from_config(config)
    assert options.skip_nonfinite and options.max_loss == 0.0
    result = _fit(tmp_path / "on", Batches(bad_step=7), options=options)  # does not raise
    assert sum(r.get("train/skipped_steps", 0) for r in result.history) == 1
    # Without options, and for configs without a train section, fit stops.
    with pytest.raises(common.NonFiniteError, match="--config.train.skip_nonfinite=True"):
        common.fit(
            _state(),
            None,
            step_fn,
            Batches(bad_step=7),
            key=jax.random.key(0),
            workdir=tmp_path / "off",
            num_steps=10,
            log_every=1,
            progress=False,
        )
    no_section = common.TrainOptions.from_config(ml_collections.ConfigDict({"log": {}}))
    assert no_section == common.TrainOptions()
    with pytest.raises(common.NonFiniteError):
        _fit(tmp_path / "none", Batches(bad_step=7), options=no_section)
    bad = ml_collections.ConfigDict({"train": {"skip_nonfinite": "yes"}})
    with pytest.raises(TypeError, match="config.train.skip_nonfinite='yes' is invalid"):
        common.TrainOptions.from_config(bad)


def _experiment_trains_with_fit(config) -> bool:
    """Whether the experiment's module, or a module of its own (``<experiment>_*.py`` in
    ``experiments`` or ``experiments/common``), fits."""
    modules = [REPO / "experiments" / f"{config.experiment}.py"]
    for folder in (REPO / "experiments", REPO / "experiments" / "common"):
        modules += sorted(folder.glob(f"{config.experiment}_*.py"))
    source = "".join(path.read_text() for path in modules)
    return "common.fit(" in source


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.py")), ids=lambda p: p.stem)
def test_every_config_that_trains_through_fit_has_the_train_section(path):
    if path.stem in ("__init__", "common", "continual_base"):
        return
    config = importlib.import_module(f"configs.{path.stem}").get_config()
    if _experiment_trains_with_fit(config):
        assert config.train.to_dict() == {"skip_nonfinite": False, "max_loss": 0.0}, path.name
    else:
        assert "train" not in config, f"{path.name}: its experiment does not call fit"


def test_step_time_survives_a_finished_rerun_and_json_is_valid(tmp_path):
    first = _fit(tmp_path, Batches())
    again = _fit(tmp_path, Batches())
    assert again.start_step == 10 and np.isfinite(again.step_time_s)
    assert again.step_time_s == pytest.approx(first.step_time_s, rel=0.05)
    assert json.loads(json.dumps(common.json_safe({"t": float("nan")}))) == {"t": None}


def test_unreadable_checkpoint_is_set_aside_and_the_previous_one_restored(tmp_path, caplog):
    _fit(tmp_path, Batches(), ckpt_every=5, max_to_keep=3)
    ckpts = tmp_path / "checkpoints"
    for f in (ckpts / "10" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"")  # truncate every data file of step 10
    manager = common.make_manager(ckpts, every=5)
    with caplog.at_level("WARNING"):
        state, _ = common.restore_latest(manager, _state())
    assert int(state["step"]) == 5
    (logged,) = [r.getMessage() for r in caplog.records]  # one line says it all
    assert logged.startswith(f"Checkpoint step 10 in {ckpts} cannot be read ("), logged
    assert logged.endswith("): set aside as unreadable_10; restored step 5 instead."), logged
    assert (ckpts / "unreadable_10").is_dir() and manager.all_steps() == [5]
    manager.close()
    # A rerun trains steps 6..10 again and saves step 10 anew.
    result = _fit(tmp_path, Batches())
    assert result.start_step == 5 and int(result.state["step"]) == 10


def test_no_readable_checkpoint_names_the_directories(tmp_path):
    _fit(tmp_path, Batches(), num_steps=5)
    for f in (tmp_path / "checkpoints" / "5" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    manager = common.make_manager(tmp_path / "checkpoints", every=5)
    with pytest.raises(common.CheckpointError) as err:
        common.restore_latest(manager, _state())
    message = str(err.value)
    assert message.startswith(f"no checkpoint can be read: {tmp_path}/checkpoints/5 (")
    assert message.endswith(
        "). Delete these step directories to start over from step 0 (or restore them from a "
        "backup)."
    )


def test_workdir_lock_refuses_a_second_run_and_takes_over_a_stale_one(tmp_path):
    with common.lock_workdir(tmp_path) as path:
        with open(path) as f:
            holder = json.load(f)
        assert holder["pid"] == os.getpid()
        busy = r"is in use by another run \(pid \d+ on "
        with pytest.raises(common.WorkdirError, match=busy), common.lock_workdir(tmp_path):
            pass
    assert not os.path.exists(path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    stale = {**holder, "pid": int(dead.stdout)}
    (tmp_path / ".lock").write_text(json.dumps(stale))
    with common.lock_workdir(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()


def _file(path):
    path.write_text("x")
    return str(path)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: "", "the workdir is empty: pass a directory, e.g. --workdir=runs/<name>"),
        (lambda d: _file(d / "f"), "workdir {} is a file, not a directory: pass another --workdir"),
        (lambda d: _file(d / "g") + "/run", "cannot create workdir {}: Not a directory"),
    ],
)
def test_unusable_workdirs_get_one_line_errors(tmp_path, make, message):
    workdir = make(tmp_path)
    with pytest.raises(common.WorkdirError) as err, common.lock_workdir(workdir):
        pass
    assert str(err.value) == message.format(workdir)


def test_read_only_workdir_is_refused(tmp_path, monkeypatch):
    workdir = tmp_path / "ro"
    workdir.mkdir()
    workdir.chmod(0o555)
    if os.access(workdir, os.W_OK):  # root ignores permission bits: make access() say no
        monkeypatch.setattr(
            "experiments.common.workdir.os.access", lambda path, mode: not mode & os.W_OK
        )
    with pytest.raises(common.WorkdirError) as err, common.lock_workdir(workdir):
        pass
    assert str(err.value) == f"workdir {workdir} is not writable: pass another --workdir"
    workdir.chmod(0o755)


def test_metrics_rewrite_on_resume_is_atomic(tmp_path, monkeypatch):
    """A crash while metrics.jsonl is rewritten for a resume leaves the old file whole."""
    writer = common.MetricWriter(tmp_path, tensorboard=False)
    for step in range(1, 6):
        writer.write(step, {"train/loss": 1.0 / step})
    writer.close()
    before = (tmp_path / "metrics.jsonl").read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("experiments.common.metrics.os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        common.MetricWriter(tmp_path, start_step=3, tensorboard=False)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_cli_empty_workdir_is_a_one_line_error(tmp_path):
    proc = run_cli(SMOKE, workdir="", timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "FATAL WorkdirError: the workdir is empty: pass a directory, e.g. --workdir=runs/<name> "
        "(LOWRANK_JAX_TRACEBACK=1 shows the traceback)"
    )


def test_cli_nan_run_fails_in_one_line_and_a_failed_start_does_not_block_the_rerun(tmp_path):
    workdir = tmp_path / "run"
    proc = run_cli(SMOKE, "--config.optim.learning_rate=1e30", workdir=workdir)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("FATAL NonFiniteError: train/loss=nan at step ")
    assert "Traceback" not in proc.stderr
    assert not (workdir / ".lock").exists()
    # Nothing was checkpointed, so the same workdir takes a corrected config.
    proc = run_cli(SMOKE, "--config.log.progress=False", workdir=workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.isfinite(final_metrics(proc.stdout)["test/loss"])


def test_cli_skip_nonfinite_config_trains_through_nan_steps(tmp_path):
    proc = run_cli(
        SMOKE,
        "--config.optim.learning_rate=1e30",
        "--config.train.skip_nonfinite=True",
        "--config.log.progress=False",
        workdir=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = int(sum(r.get("train/skipped_steps", 0) for r in common.read_metrics(tmp_path)))
    assert 0 < skipped <= 40
    # The state kept is the last finite one; with a learning rate of 1e30 its logits overflow, so
    # the test loss is NaN, reported as null (valid JSON), while the accuracy is still measured.
    metrics = final_metrics(proc.stdout)
    assert metrics["test/loss"] is None and 0.0 <= metrics["test/accuracy"] <= 1.0
    # The run says that it skipped steps: in the final JSON, in results.md and in one line.
    assert metrics["skipped_steps"] == skipped
    warning = f"WARNING {skipped} training steps were skipped (non-finite, or a loss above "
    assert warning in proc.stderr, proc.stderr[-3000:]
    assert (
        f"**Warning**: {skipped} training steps were skipped"
        in (tmp_path / "results.md").read_text()
    )


def test_cli_finite_divergence_stops_with_max_loss(tmp_path):
    # A learning rate of 1e9 diverges to a finite loss of ~1e32 and chance accuracy with rc 0;
    # train.max_loss stops it as a NaN would.
    proc = run_cli(
        SMOKE, "--config.optim.learning_rate=1e9", "--config.train.max_loss=1e3", workdir=tmp_path
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(
        r"FATAL NonFiniteError: train/loss=\S+ > train\.max_loss=1000 at step \d+: ", last
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "adapter.rank",
            65,
            "lora(rank=65) at 'params/dense_0/kernel' exceeds min(n, m) = 64 of its (64, 64) "
            "matrix view; use a rank of at most 64 (a rule per layer can set its own rank).",
        ),
        (
            "adapter.targets",
            ("params/nothing/kernel",),
            "the adapter rules match no parameter. Regexes must fully match a '/'-joined path; "
            "the available paths are:\n  params/dense_0/bias  (64,)\n  params/dense_0/kernel  "
            "(64, 64)\n",
        ),
    ],
    ids=["rank_too_large", "regex_matches_nothing"],
)
def test_a_failed_start_leaves_no_config_json(tmp_path, key, value, message):
    """config.json is written once the model and adapters exist, so nothing refuses the rerun."""
    config = digits_mlp.get_config("smoke,method=lora")
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ValueError) as err:
        train._run(config, str(tmp_path))  # what python -m experiments.train runs
    assert str(err.value).startswith(message)
    assert os.listdir(tmp_path) == []  # no config.json, no lock
    calls = []
    log = common.TrainOptions.from_config(config, on_start=lambda: calls.append(1)).log
    log.started()
    log.started()  # once only
    assert calls == [1]


def test_cli_recovers_from_a_truncated_checkpoint_in_one_line(tmp_path):
    first = run_cli(SMOKE, workdir=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    # A truncated array-metadata file: orbax fails while TensorStore reads are in flight, whose
    # late callbacks into the closed event loop used to print ~130 lines of tracebacks.
    state = tmp_path / "checkpoints" / str(steps[-1]) / "state"
    (state / "array_metadatas" / "process_0").write_text("")
    rerun = run_cli(SMOKE, workdir=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    noise = [i for i, ln in enumerate(rerun.stderr.splitlines()) if "Traceback" in ln]
    lines = rerun.stderr.splitlines()
    shown = "\n".join(lines[max(0, noise[0] - 5) : noise[0] + 60]) if noise else ""
    assert "Event loop is closed" not in rerun.stderr and not noise, shown
    said = [ln for ln in rerun.stderr.splitlines() if "cannot be read" in ln]
    assert len(said) == 1 and said[0].endswith(
        f"set aside as unreadable_{steps[-1]}; restored step {steps[-2]} instead."
    ), rerun.stderr[-3000:]
    for key in ("test/loss", "test/accuracy"):  # the retrained steps end where they did
        assert final_metrics(rerun.stdout)[key] == pytest.approx(final_metrics(first.stdout)[key])


def test_the_closed_loop_filter_drops_only_closed_loop_errors():
    """TensorStore's late callbacks arrive as ``Event loop is closed``, raised in
    ``call_soon_threadsafe`` or while handling the failed read (the route on a loaded machine)."""
    from types import SimpleNamespace

    from experiments.common.checkpoint import _is_closed_loop_callback

    def raised(exc, context=None):
        try:
            try:
                if context is not None:
                    raise context
            finally:
                raise exc
        except BaseException as e:  # noqa: BLE001 - the exception object is what is tested
            return SimpleNamespace(exc_value=e)

    closed = RuntimeError("Event loop is closed")
    assert _is_closed_loop_callback(raised(closed, context=OSError("read failed")))
    assert _is_closed_loop_callback(raised(RuntimeError("Event loop is closed")))
    assert not _is_closed_loop_callback(raised(RuntimeError("something else")))
    assert not _is_closed_loop_callback(raised(ValueError("Event loop is closed")))
