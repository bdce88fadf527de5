"""Every run reports its cost (throughput, FLOPs, utilisation, peak memory) and takes a profile by
flag: ``experiments/common/cost.py`` through the real CLI, and its pieces."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import configs.common
from experiments import common
from experiments.common import cost, sweep
from tests.experiments.test_train_cli import SMOKE, run_cli

# 8,970 parameters; batch 64: one forward is ~2·64·8,970 FLOPs, a training step about three.
MLP_PARAMS, BATCH = 2 * (64 * 64 + 64) + 64 * 10 + 10, 64


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The digits smoke run with a peak of 1 TFLOP/s (CPU has none) and steps 12-14 traced."""
    workdir = tmp_path_factory.mktemp("cost") / "run"
    proc = run_cli(
        SMOKE,
        "--config.log.progress=False",
        "--config.hardware.peak_tflops=1.0",
        "--config.profile.start_step=12",
        "--config.profile.num_steps=3",
        workdir=workdir,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return workdir


def test_smoke_run_metrics_hold_the_cost(smoke_run):
    train = [r for r in common.read_metrics(smoke_run) if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(5, 41, 5))
    for r in train:
        assert 1e2 < r["cost/examples_per_s"] < 1e8, r
        # XLA's count of the compiled step: between one forward and a few forward passes.
        assert 2 * BATCH * MLP_PARAMS < r["cost/flops_per_step"] < 8 * BATCH * MLP_PARAMS
        achieved = r["cost/flops_per_step"] * r["cost/examples_per_s"] / BATCH / 1e12
        assert r["cost/tflops_per_s_per_device"] == pytest.approx(achieved, rel=1e-6)
        # utilisation against the stated peak of 1 TFLOP/s per device
        assert r["cost/utilisation"] == pytest.approx(r["cost/tflops_per_s_per_device"])
        assert 0 < r["cost/utilisation"] < 1
        # CPU reports no device memory: the peak RSS of the process (a JAX process: > 100 MB)
        assert "cost/peak_device_memory_bytes" not in r
        assert 1e8 < r["cost/peak_host_rss_bytes"] < 1e11
        assert "cost/tokens_per_s" not in r  # digits are not sequences
    results = (smoke_run / "results.md").read_text()
    assert "## Cost" in results and "| mlp/full | 1 | 39 |" in results
    assert "peak 1 TFLOP/s per device" in results
    # cost records are measurements, not curves: no plot of them
    assert not list(smoke_run.glob("*per_s*.png")) and not (smoke_run / "utilisation.png").exists()


def test_profile_flag_writes_a_tensorboard_trace(smoke_run):
    sessions = list((smoke_run / "profile" / "plugins" / "profile").iterdir())
    assert len(sessions) == 1  # one trace per run
    traces = list(sessions[0].glob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0


def test_no_profile_by_default(tmp_path):
    workdir = tmp_path / "run"
    options = common.TrainOptions.from_config(
        configs.common.ml_collections.ConfigDict({"profile": configs.common.profile_section()}),
        workdir,
    )
    assert options.profile_steps == 0 and options.profile_dir == str(workdir / "profile")
    meter = cost.StepMeter("x", options)
    assert all(meter.profile(step, None) == 0.0 for step in range(1, 30))
    assert not (workdir / "profile").exists() and not options.log.profiled


def test_bad_options_fail_with_the_key():
    config = configs.common.ml_collections.ConfigDict(
        {"hardware": configs.common.hardware_section(), "profile": configs.common.profile_section()}
    )
    config.hardware.peak_tflops = -3.0
    with pytest.raises(ValueError, match="config.hardware.peak_tflops=-3.0"):
        common.TrainOptions.from_config(config)
    config.hardware.peak_tflops = None
    config.profile.num_steps = 2
    config.profile.start_step = 0
    with pytest.raises(ValueError, match="config.profile.start_step=0"):
        common.TrainOptions.from_config(config)
    config.profile.start_step = 3
    config.hardware.peak_tflops = 275
    options = common.TrainOptions.from_config(config, "/run")
    assert (options.peak_tflops, options.profile_start, options.profile_steps) == (275.0, 3, 2)
    assert options.profile_dir == "/run/profile"
    # The peak is detected when the config does not set it (none on CPU), as without a config.
    assert common.TrainOptions().peak_tflops == cost.peak_tflops()


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("TPU v4", 275.0),
        ("TPU v5 lite", 197.0),
        ("TPU v5", 459.0),
        ("TPU v6 lite", 918.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("cpu", None),
    ],
)
def test_peak_tflops_by_device_kind(kind, peak):
    assert cost.peak_tflops(kind) == peak


def test_config_table_of_peaks_agrees_with_the_detection():
    for name, peak in configs.common.PEAK_TFLOPS.items():
        assert cost.peak_tflops(name) == peak, name


def test_batch_size_counts_examples_and_tokens():
    assert cost.batch_size_of({"x": np.zeros((8, 64)), "y": np.zeros(8, np.int32)}) == (8, 0)
    batch = {"input_ids": np.zeros((4, 16), np.int32), "attention_mask": np.ones((4, 16))}
    assert cost.batch_size_of(batch) == (4, 64)


def test_scan_body_is_counted_once():
    """The assumption behind train_scan's FLOPs per step: XLA counts a loop body once."""

    def one(w, x):
        return jnp.tanh(x @ w)

    def many(w, x):
        return jax.lax.scan(lambda c, _: (one(w, c), None), x, None, length=25)[0]

    w, x = jnp.ones((32, 32)), jnp.ones((16, 32))
    flops_one = cost.compiled_flops(jax.jit(one).lower(w, x).compile())
    flops_many = cost.compiled_flops(jax.jit(many).lower(w, x).compile())
    assert flops_one > 2 * 16 * 32 * 32 * 0.99
    assert flops_many == pytest.approx(flops_one, rel=0.05)


def _loss(p, frozen, batch):
    del frozen
    return jnp.mean((batch["x"] @ p - batch["y"]) ** 2)


def test_sweep_cells_report_their_cost(tmp_path):
    rng = np.random.default_rng(0)
    train = {"x": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)}
    train["y"] = train["x"] @ jnp.ones(8)
    idx = jnp.asarray(sweep.batch_indices(0, 64, 16, 30))
    options = common.TrainOptions.from_config({}, tmp_path)
    cells = sweep.CellStore(tmp_path, options=options)

    def cell():
        p, _, trace = sweep.train_scan(
            jnp.zeros(8), None, train, idx, loss_fn=_loss, tx=optax.sgd(0.1), options=options
        )
        return {"loss": float(trace[-1])}

    cells.get("a", cell)
    (tmp_path / "results.md").write_text("# results\n")
    cost.append_cost_table(tmp_path, options)
    cells.close()
    [record] = common.read_metrics(tmp_path)
    assert record["a/loss"] < 1.0
    assert record["a/cost/timed_steps"] == 30
    assert record["a/cost/examples_per_s"] > 0
    assert 2 * 16 * 8 <= record["a/cost/flops_per_step"] < 1e6
    assert options.log.rows and options.log.rows[0]["label"] == "train_scan _loss (batch 16)"
    text = (tmp_path / "results.md").read_text()
    assert "## Cost" in text and "| train_scan _loss (batch 16) | 1 | 30 |" in text
    assert math.isfinite(record["a/cost/train_s"])
