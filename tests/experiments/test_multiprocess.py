"""Two processes on one machine (4 fake CPU devices each, gloo collectives) train like one process
with 8 devices, write one checkpoint, stop with a clear message when a peer dies, stop together
at one step when one of them gets SIGTERM (a preemption notice), and resume.

Cases: ``digits_mlp`` (the fast config of the machinery tests; killed at step 20, resumed), a
continual stream (sequential LoRA on ``digits_cil``: one ``fit`` per task, host-side
consolidation between tasks; SABER passes too, at twice the CPU time), the real MiniLM
(``lora_finetune:smoke``, about 100 CPU-seconds for its three processes) and the decoder LLM
(``llm_lora:smoke`` made tiny: pretraining, the Hugging Face round trip, LoRA and QLoRA on the
scanned stack, data-parallel over the two processes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from experiments import common
from experiments.common import supervisor
from tests.experiments.test_train_cli import REPO, final_metrics

DIGITS = (
    "--config=configs/digits_mlp.py:smoke",
    "--config.schedule.num_steps=60",
    "--config.log.every=5",
    "--config.log.progress=False",
)
CONTINUAL = (
    # The masked head. digits_cil's default aligned head re-fits the head by 200 Adam steps on
    # pseudo-features, which turns the last-bit differences of a changed all-reduce order into
    # accuracy: one process with 1, 4 or 8 devices gives 0.9154, 0.9199, 0.9176 (and 2 x 4, 0.9154).
    "--config=configs/saber.py:smoke,method=seq_lora,benchmark=digits_cil,head=masked",
    "--config.schedule.steps_per_task=10",
    "--config.log.every=5",
    "--config.log.progress=False",
)
MINILM = ("--config=configs/lora_finetune.py:smoke", "--config.log.progress=False")
LLM = (  # llm_lora:smoke made tiny (one scanned layer): pretraining, the HF round trip, LoRA
    # and QLoRA (the NF4 base's uint4 arrays go through fit's jitted step; on CPU the executable
    # compiled ahead of time refuses their layout, JAX 0.10.2).
    "--config=configs/llm_lora.py:smoke",
    "--config.model.num_hidden_layers=1",
    "--config.model.pretrain_steps=6",
    "--config.schedule.num_steps=4",
    "--config.schedule.warmup_steps=1",
    "--config.finetune.learning_rates=(0.01,)",
    "--config.finetune.methods=('float32', 'nf4')",
    "--config.finetune.bases=('float32', 'nf4')",
    "--config.data.max_passages_per_play=12",
    "--config.data.finetune_examples=64",
    "--config.data.passage_chars=64",
    "--config.eval.sample_prompt_chars=16",
    "--config.eval.sample_tokens=4",
    "--config.eval.num_samples=1",
    "--config.ckpt.every=2",
    "--config.log.every=2",
    "--config.log.progress=False",
)
DISTRIBUTED = "--config.parallel.distributed=True"
# float32 sums reduced in another order: 1e-5 absolute, or 1e-6 relative for large values (the
# decoder's perplexities, exp of a mean NLL, are ~130 after its few pretraining steps)
TOL = {"abs": 1e-5, "rel": 1e-6}
TIMEOUT = 900  # seconds for any one run (a loaded machine is slow); no wait is unbounded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra: str) -> dict[str, str]:
    flags = f"--xla_force_host_platform_device_count={devices}"
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **extra}


def _popen(args, workdir, env):
    cmd = [sys.executable, "-m", "experiments.train", *args, f"--workdir={workdir}"]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _launch(args, workdir, *extra: str):
    """The two processes of one job (the same command; JAX_PROCESS_ID 0 and 1)."""
    port = _free_port()
    jax_env = {"JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2"}
    jax_env["JAX_HEARTBEAT_TIMEOUT_SECONDS"] = "10"
    return [
        _popen((*args, DISTRIBUTED, *extra), workdir, _env(4, **jax_env, JAX_PROCESS_ID=str(i)))
        for i in range(2)
    ]


def _finish(procs, timeout=TIMEOUT):
    """``[(returncode, stdout, stderr)]``; kills every process still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def _close(records, reference):
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference, strict=True):
        for key in want:
            if key.startswith("cost/"):  # throughput and memory measure a process, not results
                continue
            assert got[key] == pytest.approx(want[key], **TOL), (got["step"], key)


def _runs(workdir):
    """``{relative dir: metrics.jsonl records}`` of every ``fit`` run under ``workdir``."""
    return {
        os.path.relpath(root, workdir): common.read_metrics(root)
        for root, _, files in os.walk(workdir)
        if common.metrics.METRICS_FILE in files
    }


def _checkpoints(workdir):
    """``{checkpoints dir: {step: meta without timing}}``; asserts no temporary directory is left."""
    out = {}
    for root, dirs, _ in os.walk(workdir):
        if os.path.basename(root) != "checkpoints":
            continue
        assert all(d.isdigit() for d in dirs), (root, dirs)  # no orbax temporaries
        metas = {}
        for d in dirs:
            assert os.path.exists(os.path.join(root, d, "commit_success.txt")), (root, d)
            with open(os.path.join(root, d, "meta", "metadata")) as f:
                metas[int(d)] = {k: v for k, v in json.load(f).items() if k != "timing"}
        out[os.path.relpath(root, workdir)] = metas
        dirs[:] = []
    return out


def _writers(workdir):
    """``{checkpoint step dir: processes whose array metadata it holds}`` under ``workdir``."""
    return {
        os.path.relpath(os.path.dirname(root), workdir): sorted(files)
        for root, _, files in os.walk(workdir)
        if os.path.basename(root) == "array_metadatas"
    }


def _numbers(result):
    """The numeric leaves of the final JSON, flattened: ``{"table/saber/final_acc": ...}``."""
    out = {}
    for k, v in result.items():
        if isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in _numbers(v).items()})
        elif isinstance(v, float) and k not in ("step_time_s",):
            out[k] = v
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("single")
    ((code, out, err),) = _finish([_popen(DIGITS, workdir, _env(8))])
    assert code == 0, err[-3000:]
    return final_metrics(out), common.read_metrics(workdir), workdir


@pytest.mark.parametrize("args", [CONTINUAL, MINILM, LLM], ids=["continual", "minilm", "llm"])
def test_two_processes_train_like_one_with_eight_devices(tmp_path, args):
    # The reference (1 process x 8 devices) runs alongside the two processes.
    procs = [_popen(args, tmp_path / "single", _env(8)), *_launch(args, tmp_path / "two")]
    results = _finish(procs)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    want = _numbers(final_metrics(results[0][1]))
    assert want
    for _, out, _ in results[1:]:  # both processes report the single process's final metrics
        got = _numbers(final_metrics(out))
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], **TOL), key
    runs, reference = _runs(tmp_path / "two"), _runs(tmp_path / "single")
    assert runs.keys() == reference.keys() and runs
    for name in reference:
        _close(runs[name], reference[name])
    # One checkpoint per step, committed once, with the data position and key of the reference.
    assert _checkpoints(tmp_path / "two") == _checkpoints(tmp_path / "single")
    writers = _writers(tmp_path / "two")  # each step written by both processes together
    assert writers and all(w == ["process_0", "process_1"] for w in writers.values()), writers
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "single"))


def test_a_killed_peer_stops_the_other_with_one_line_and_both_resume(tmp_path, single):
    procs = _launch(DIGITS, tmp_path, "--config.ckpt.every=10")  # (the smoke default)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "checkpoints" / "20").is_dir():
            assert time.monotonic() < deadline and procs[0].poll() is None, "no checkpoint 20"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)  # its training process goes with it
        ((code, _, err),) = _finish([procs[0]], timeout=240)  # exits, does not hang
    finally:
        _finish(procs, timeout=60)
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("FATAL process 0 of 2 stopped because "), err[-3000:]
    # JAX names the dead process when its heartbeats stop; gloo, if its collective breaks first,
    # does not.
    assert last.split(" because ")[1].startswith(
        ("process 1 died (it stopped sending heartbeats", "another process of the job died (")
    ), last
    assert last.endswith(
        f"Rerun the same command in all 2 processes to resume from the last checkpoint in "
        f"{tmp_path}."
    )
    # Both rerun: they resume from step 20 and end where one process with 8 devices ends.
    results = _finish(_launch(DIGITS, tmp_path, "--config.ckpt.every=10"))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    for _, out, _ in results:  # both processes report the same final metrics
        assert final_metrics(out)["test/loss"] == pytest.approx(single[0]["test/loss"], abs=1e-5)
    _close(common.read_metrics(tmp_path), single[1])
    # One checkpoint per step, committed once, with the data position and key of the reference.
    assert _checkpoints(tmp_path) == _checkpoints(single[2])
    assert max(_checkpoints(tmp_path)["checkpoints"]) == 60
    assert _writers(tmp_path)["checkpoints/60/state"] == ["process_0", "process_1"]


def test_sigterm_to_one_process_stops_both_at_one_step_and_both_resume(tmp_path, single):
    # A scheduler's preemption notice reaching one process: JAX's preemption service tells the
    # other, both save the same step (each its shards) and exit 143; the rerun resumes there.
    procs = _launch(DIGITS, tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not common.read_metrics(tmp_path):  # the first record: training has started
            assert time.monotonic() < deadline and procs[0].poll() is None, "no training"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        results = _finish(procs, timeout=240)
    finally:
        _finish(procs, timeout=60)
    steps = set()
    for code, out, err in results:
        assert code == 143, err[-3000:]
        stopped = final_metrics(out)
        assert stopped["interrupted"], out
        steps.add(stopped["steps"])
        assert "Stopped by SIGTERM (a preemption notice to the job) at step" in err, err[-3000:]
    (step,) = steps  # the same step in both processes
    assert step < 60 and not (tmp_path / ".lock").exists()
    assert _writers(tmp_path)[f"checkpoints/{step}/state"] == ["process_0", "process_1"]
    results = _finish(_launch(DIGITS, tmp_path))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    _close(common.read_metrics(tmp_path), single[1])
    assert _checkpoints(tmp_path) == _checkpoints(single[2])


@pytest.mark.parametrize(
    ("tail", "code", "cause"),
    [
        (
            "F1203 client.h:80] Terminating process because the JAX distributed service detected "
            "fatal errors. ... UNAVAILABLE: The following tasks are unhealthy (stopped sending "
            "heartbeats):\n/job:jax_worker/replica:0/task:1\nThe tasks have crashed.",
            -6,
            "process 1 died (it stopped sending heartbeats to the JAX coordinator)",
        ),
        (
            "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n"
            "The tasks have crashed. Check the task logs",
            -6,
            "process 1 died (it stopped sending heartbeats to the JAX coordinator)",
        ),
        (
            "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  "
            "[enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes.",
            -6,
            "another process of the job died (the connection of a gloo collective broke: "
            "\"terminate called after throwing an instance of 'gloo::EnforceNotMet'\")",
        ),
        ("", -9, "its training process was killed by SIGKILL (out of memory?); the other"),
    ],
    ids=["heartbeats", "heartbeats_bare", "gloo", "signal"],
)
def test_peer_failure_messages(monkeypatch, tail, code, cause):
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    message = supervisor.peer_failure_message(tail, code, workdir="runs/x")
    assert message.startswith(f"FATAL process 0 of 2 stopped because {cause}")
    assert message.endswith(
        ". Rerun the same command in all 2 processes to resume from the last checkpoint in runs/x."
    )
    # A run that finished, was stopped by Ctrl-C, or failed by itself (its own FATAL line) is
    # left alone.
    for own in (0, 130, 1):
        assert supervisor.peer_failure_message("FATAL Invalid config", own, workdir=".") is None


def test_a_gloo_error_in_this_process_is_one_line(monkeypatch):
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    error = RuntimeError(
        "UNKNOWN: Gloo context initialization failed: [external/gloo/gloo/transport/tcp/"
        "pair.h:311] Connect timeout [none]"
    )
    message = supervisor.collective_failure_message(error, workdir="runs/x")
    assert message.startswith(
        "FATAL process 0 of 2 stopped because a collective with the other processes failed "
        "('UNKNOWN: Gloo context initialization failed: "
    )
    assert "a peer died, or reached that step more than gloo's ~30 s later" in message
    assert message.endswith("in all 2 processes to resume from the last checkpoint in runs/x.")
    assert supervisor.collective_failure_message(RuntimeError("out of memory"), workdir=".") is None
