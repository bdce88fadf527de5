"""Kill-and-resume: a run stopped by SIGKILL, Ctrl-C, SIGTERM or SIGUSR1 and rerun ends exactly where an uninterrupted
run does (same final metrics, same metrics.jsonl), through the real CLI in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import common
from tests.experiments.test_train_cli import REPO, final_metrics, run_cli

NUM_STEPS = 300
ARGS = (
    "--config=configs/digits_mlp.py",
    f"--config.schedule.num_steps={NUM_STEPS}",
    "--config.ckpt.every=20",
    "--config.eval.every=100",
    "--config.log.every=20",
    "--config.log.progress=False",
)
COMPARED = ("test/accuracy", "test/loss", "valid/accuracy", "valid/loss", "steps")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its final metrics and metrics.jsonl records."""
    workdir = tmp_path_factory.mktemp("reference")
    proc = run_cli(*ARGS, workdir=workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return final_metrics(proc.stdout), common.read_metrics(workdir)


def _start(workdir):
    cmd = [sys.executable, "-m", "experiments.train", *ARGS, f"--workdir={workdir}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_checkpoint(proc, workdir, step, timeout=240.0):
    path = workdir / "checkpoints" / str(step)
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        if proc.poll() is not None:
            raise AssertionError(
                f"run ended before checkpoint {step}:\n{proc.stderr.read()[-4000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no checkpoint {step} after {timeout} s")
        time.sleep(0.005)


def _checkpoint_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _assert_same_run(metrics, records, reference):
    ref_metrics, ref_records = reference
    for key in COMPARED:
        assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-6), key
    assert [r["step"] for r in records] == [r["step"] for r in ref_records]
    for got, want in zip(records, ref_records, strict=True):
        # cost/* (throughput, memory) are measurements of each process, not results
        got, want = _results(got), _results(want)
        assert got.keys() == want.keys()
        for key in got:
            assert got[key] == pytest.approx(want[key], abs=1e-6), (got["step"], key)


def _results(record):
    return {k: v for k, v in record.items() if not k.startswith("cost/")}


def test_sigkill_then_rerun_equals_uninterrupted_run(tmp_path, reference):
    proc = _start(tmp_path)
    _wait_for_checkpoint(proc, tmp_path, 20)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    steps = _checkpoint_steps(tmp_path)
    assert steps and max(steps) < NUM_STEPS and all(s % 20 == 0 for s in steps)

    rerun = run_cli(*ARGS, workdir=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert f"Resumed from {tmp_path / 'checkpoints'} at step {max(steps)}" in rerun.stderr
    _assert_same_run(final_metrics(rerun.stdout), common.read_metrics(tmp_path), reference)


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name
)
def test_a_stop_signal_saves_and_exits_cleanly_then_rerun_resumes(tmp_path, reference, signum):
    # Ctrl-C, a scheduler's SIGTERM (preemptible VMs, Slurm, Kubernetes, timeout) and SIGUSR1.
    proc = _start(tmp_path)
    _wait_for_checkpoint(proc, tmp_path, 20)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr[-4000:]
    assert "Traceback" not in stderr
    stopped = final_metrics(stdout)
    assert stopped["interrupted"] and 20 <= stopped["steps"] < NUM_STEPS
    # One line says which signal, the step saved and how to resume; the workdir is released.
    said = [line for line in stderr.splitlines() if f"Stopped by {signum.name} at step" in line]
    assert len(said) == 1 and said[0].endswith("Rerun the same command to resume."), stderr
    assert f"at step {stopped['steps']} of {NUM_STEPS}" in said[0]
    assert not (tmp_path / ".lock").exists()
    # The checkpoint is of the step it stopped at, not only of the last periodic one.
    assert max(_checkpoint_steps(tmp_path)) == stopped["steps"]

    if signum == signal.SIGUSR1:  # the same path as SIGTERM from here on (saves suite time)
        return
    rerun = run_cli(*ARGS, workdir=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    _assert_same_run(final_metrics(rerun.stdout), common.read_metrics(tmp_path), reference)
    if signum != signal.SIGINT:
        return

    # Rerunning a finished run trains nothing and reports the same metrics again.
    again = run_cli(*ARGS, workdir=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    _assert_same_run(final_metrics(again.stdout), common.read_metrics(tmp_path), reference)
    assert json.loads((tmp_path / "config.json").read_text())["schedule"]["num_steps"] == NUM_STEPS


def test_metric_writer_drops_records_after_the_restored_step(tmp_path):
    writer = common.MetricWriter(tmp_path, tensorboard=False)
    for step in range(1, 6):
        writer.write(step, {"train/loss": 1.0 / step})
    writer.close()
    # A run killed after step 5 but resumed from the checkpoint of step 3 rewrites steps 4, 5.
    writer = common.MetricWriter(tmp_path, start_step=3, tensorboard=False)
    assert [r["step"] for r in common.read_metrics(tmp_path)] == [1, 2, 3]
    writer.write(4, {"train/loss": 0.5})
    writer.close()
    assert common.read_metrics(tmp_path)[-1] == {"step": 4, "train/loss": 0.5}


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    # tensorboardX imports torch when it is installed (the peers extra is, here); the writer keeps
    # it out of every run process. In a fresh interpreter: pytest's may have imported torch.
    pytest.importorskip("torch")
    code = (
        "import sys, glob\n"
        "from experiments import common\n"
        f"w = common.MetricWriter({str(tmp_path)!r})\n"
        "w.write(1, {'train/loss': 0.5}); w.close()\n"
        f"assert glob.glob({str(tmp_path / 'tensorboard' / 'events.out.tfevents.*')!r})\n"
        "assert 'torch' not in sys.modules\n"
        "import torch  # still importable afterwards\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
