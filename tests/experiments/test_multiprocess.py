"""Two processes on one machine (4 fake CPU devices each, gloo collectives) train like one process
with 8 devices, write one checkpoint, stop cleanly when a peer dies, and resume."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from experiments import common
from tests.experiments.test_train_cli import REPO, final_metrics, run_cli

ARGS = (
    "--config=configs/digits_mlp.py:smoke",
    "--config.schedule.num_steps=60",
    "--config.log.every=5",
    "--config.log.progress=False",
)
DISTRIBUTED = "--config.parallel.distributed=True"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(workdir, *extra: str):
    port = _free_port()
    procs = []
    for i in range(2):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
            "JAX_HEARTBEAT_TIMEOUT_SECONDS": "10",
        }
        cmd = [sys.executable, "-m", "experiments.train", *ARGS, DISTRIBUTED, *extra]
        procs.append(
            subprocess.Popen(
                [*cmd, f"--workdir={workdir}"],
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )  # fmt: skip
        )
    return procs


def _finish(procs, timeout=400):
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def _close(records, reference):
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference, strict=True):
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-5), (got["step"], key)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("single")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = run_cli(*ARGS, workdir=workdir, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_metrics(proc.stdout), common.read_metrics(workdir)


def test_two_processes_train_like_one_with_eight_devices(tmp_path, single):
    results = _finish(_launch(tmp_path))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    for _, out, _ in results:  # both processes report the same final metrics
        assert final_metrics(out)["test/loss"] == pytest.approx(single[0]["test/loss"], abs=1e-5)
    _close(common.read_metrics(tmp_path), single[1])
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())[-1] == 60


def test_a_killed_peer_stops_the_other_and_both_resume(tmp_path, single):
    procs = _launch(tmp_path, "--config.ckpt.every=10")
    deadline = time.monotonic() + 300
    while not (tmp_path / "checkpoints" / "20").is_dir():
        assert time.monotonic() < deadline and procs[0].poll() is None, "no checkpoint 20"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    code, _, err = _finish([procs[0]], timeout=240)[0]  # exits, does not hang
    assert code != 0 and "Traceback" not in err.splitlines()[-1]
    procs[1].wait()
    results = _finish(_launch(tmp_path, "--config.ckpt.every=10"))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert final_metrics(results[0][1])["test/loss"] == pytest.approx(
        single[0]["test/loss"], abs=1e-5
    )
    _close(common.read_metrics(tmp_path), single[1])
