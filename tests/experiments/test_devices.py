"""Data parallelism: 8 fake CPU devices (replicated or FSDP parameters) give the losses of 1 device."""

from __future__ import annotations

import re

import pytest
from jax.sharding import PartitionSpec as P

from experiments import common
from experiments.common import sharding
from tests.experiments.test_train_cli import final_metrics, run_cli

# Hidden layers of 256 make kernels large enough (>= 2**14 entries) for FSDP to shard them.
ARGS = (
    "--config=configs/digits_mlp.py:smoke",
    "--config.model.features=(256, 256)",
    "--config.log.every=2",
    "--config.log.progress=False",
)


def _run(workdir, devices: int, *extra: str):
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = run_cli(*ARGS, *extra, workdir=workdir, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, final_metrics(proc.stdout), common.read_metrics(workdir)


def _sharded_arrays(stderr: str, devices: int) -> int:
    """How many state arrays ``fit`` reports as sharded over the mesh."""
    match = re.search(rf"Mesh of {devices} devices;.*; (\d+) of \d+ parameter", stderr)
    assert match, stderr[-2000:]
    return int(match.group(1))


def _assert_close(records, reference, tol=1e-5):
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference, strict=True):
        # cost/* (throughput, FLOPs per device, memory) measure the run, they are not results
        got, want = ({k: v for k, v in r.items() if not k.startswith("cost/")} for r in (got, want))
        assert got.keys() == want.keys()
        for key in got:
            assert got[key] == pytest.approx(want[key], abs=tol), (got["step"], key)


def test_eight_devices_give_the_losses_of_one(tmp_path):
    one_proc, one, one_records = _run(tmp_path / "one", 1)
    assert _sharded_arrays(one_proc.stderr, 1) == 0

    eight_proc, eight, eight_records = _run(tmp_path / "eight", 8)
    assert _sharded_arrays(eight_proc.stderr, 8) == 0  # parameters replicated, batch split
    _assert_close(eight_records, one_records)
    for key in ("test/loss", "test/accuracy"):
        assert eight[key] == pytest.approx(one[key], abs=1e-5)

    fsdp_proc, fsdp, fsdp_records = _run(tmp_path / "fsdp", 8, "--config.parallel.fsdp=True")
    # The two hidden kernels (64 x 256, 256 x 256) and their two Adam moments each are split.
    assert _sharded_arrays(fsdp_proc.stderr, 8) == 6
    _assert_close(fsdp_records, one_records)
    assert fsdp["test/loss"] == pytest.approx(one["test/loss"], abs=1e-5)


@pytest.mark.parametrize(
    ("shape", "spec"),
    [
        ((64, 256), P(None, "data")),  # the larger axis that 8 divides
        ((30522, 384), P(None, "data")),  # MiniLM's word embeddings: 30522 is not divisible by 8
        ((1536, 384), P("data", None)),
        ((100, 10), P()),  # below min_size: replicated
        ((16385,), P()),  # large, but no axis divisible by 8
        ((), P()),
    ],
)
def test_fsdp_splits_the_largest_divisible_axis(shape, spec):
    assert sharding._fsdp_spec(shape, 8, 2**14) == spec
    assert sharding._fsdp_spec(shape, 1, 2**14) == P()


def test_llm_sft_with_fsdp_on_eight_devices_gives_the_losses_of_one(tmp_path):
    """The fine-tuning job (#46): the smoke run of ``configs/llm_sft.py`` (a tiny Llama and its
    data built in the workdir) with FSDP over 8 fake devices trains as on one device."""
    args = ("--config=configs/llm_sft.py:smoke", "--config.schedule.num_steps=8")
    args += ("--config.log.progress=False", "--config.log.every=2", "--config.eval.sample_tokens=4")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    one = run_cli(*args, workdir=tmp_path / "one", env={"XLA_FLAGS": ""})
    fsdp = run_cli(*args, "--config.parallel.fsdp=True", workdir=tmp_path / "fsdp", env=env)
    assert one.returncode == 0, one.stderr[-4000:]
    assert fsdp.returncode == 0, fsdp.stderr[-4000:]
    assert _sharded_arrays(fsdp.stderr, 8) > 0
    got, want = final_metrics(fsdp.stdout), final_metrics(one.stdout)
    for key in ("valid_loss_before", "valid_loss_after"):
        assert got[key] == pytest.approx(want[key], abs=1e-4), key
    assert got["valid_loss_after"] < got["valid_loss_before"]
