"""``python -m experiments.bench.adapter_step --quick``: runs end to end, prints JSON.

No timing assertions (speed is what the benchmark reports); what is checked are identities: every
method starts from the same function (equal first losses), the factorised LoRA step has no
weight-shaped matmul in its optimised HLO, and its state is exactly ``3 · 4 B · Σ r·(m+n)``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from experiments.bench import adapter_step, common

REPO = pathlib.Path(__file__).resolve().parents[2]
KEYS = {
    "lora_vs_full_step",
    "lora_vs_full_temp_bytes",
    "lora_vs_peft_rss",
    "lora_vs_peft_rss_rise",
    "lora_vs_full_cpu_fused",
    "lora_fused_weight_shaped_dots",
    "factorised_vs_full_temp_bytes",
    "loss0_low_precision",
    "linen_vs_full_step",
    "merge_vs_full_step",
    "lora_vs_peft_step",
    "linen_vs_peft_step",
    "lora_vs_full_cpu",
    "lora_vs_peft_cpu",
    "lora_vs_full_flops",
    "lora_vs_full_xla_bytes",
    "lora_vs_full_rss_rise",
    "lora_weight_shaped_dots",
    "lora_state_bytes",
    "lora_state_bytes_formula",
    "full_state_bytes",
    "peft_state_bytes",
    "step_s",
    "cpu_s",
    "all_step_s",
    "loss0_spread",
    "shape",
}
HAS_PEFT = all(importlib.util.find_spec(m) is not None for m in ("torch", "peft"))


@pytest.fixture(scope="module")
def quick():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.adapter_step", "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_last_line_is_the_json_headline(quick):
    headline = json.loads(quick.strip().splitlines()[-1])
    assert set(headline) >= KEYS
    for name in (
        "full",
        "merge",
        "lora-quax",
        "lora-linen",
        "lora-fused",
        "lora-bf16",
        "lora-int8",
    ):
        assert headline["step_s"][name] > 0
    assert headline["lora_vs_full_temp_bytes"] > 0 and "curve" not in headline
    assert headline["shape"] == {
        "batch": 3, "seq": 16, "d": 64, "mlp": 256, "heads": 4, "rank": 8,
        "threads": common.num_threads(),
    }  # fmt: skip
    if HAS_PEFT:
        assert headline["lora_vs_peft_step"] > 0 and "peft" in headline["step_s"]
        assert headline["lora_vs_peft_rss"] > 0
        rise = headline["lora_vs_peft_rss_rise"]  # None where PEFT's step raised RSS by nothing
        assert rise is None or rise >= 0
    else:
        assert headline["lora_vs_peft_step"] is None and headline["lora_vs_peft_rss"] is None
        assert headline["lora_vs_peft_rss_rise"] is None


def test_table_lists_every_method(quick):
    lines = quick.splitlines()
    assert any(line.startswith("| method | step s (median) | × full | × PEFT") for line in lines)
    methods = ["full", "merge", "lora-quax", "lora-linen", "lora-fused", "lora-bf16", "lora-int8"]
    methods += ["peft"] if HAS_PEFT else []
    for name in methods:
        assert any(line.startswith(f"| {name} |") for line in lines), name


def test_identities_of_the_quick_run(quick):
    headline = json.loads(quick.strip().splitlines()[-1])
    # Zero-initialised adapters: every method (PEFT included) starts at the base block's loss.
    assert headline["loss0_spread"] <= 1e-5
    # The factorised and fused steps form no weight gradient; full fine-tuning forms 6.
    assert headline["lora_weight_shaped_dots"] == 0
    assert headline["lora_fused_weight_shaped_dots"] == 0
    # A low-precision base changes the function a little (the base kernels are rounded).
    loss0 = headline["step_s"] and headline["loss0_low_precision"]
    assert set(loss0) == {"lora-bf16", "lora-int8"}
    # Factors + Adam's mu and nu in f32, plus Adam's int32 count: O(r·(m+n)), not O(m·n).
    assert headline["lora_state_bytes"] == headline["lora_state_bytes_formula"] + 4
    d, f, r = 64, 256, 8
    assert headline["lora_state_bytes_formula"] == 12 * r * (8 * d + 2 * (d + f))
    if HAS_PEFT:  # torch's Adam keeps one f32 `step` per parameter tensor (12 of them)
        assert headline["peft_state_bytes"] == headline["lora_state_bytes_formula"] + 12 * 4


def test_weight_shaped_dots_finds_the_weight_gradient_only():
    def dense(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    def merged(a, b, w, x):
        return dense(w + a @ b, x)

    def factorised(a, b, w, x):
        return jnp.sum(jnp.tanh(x @ w + (x @ a) @ b))

    w, x = jnp.ones((64, 32)), jnp.ones((48, 64))
    a, b = jnp.ones((64, 4)), jnp.ones((4, 32))

    def dots(f, *args):
        hlo = jax.jit(jax.grad(f)).lower(*args).compile().as_text()
        return common.weight_shaped_dots(hlo, [(64, 32)], min_contraction=48)

    assert dots(dense, w, x) == ["(64, 32) <- contract 48"]
    assert dots(merged, a, b, w, x) == ["(64, 32) <- contract 48"]  # ∂L/∂(W + AB), then ·Bᵀ
    assert dots(factorised, a, b, w, x) == []


def test_run_rounds_interleaves_and_keeps_the_first_result():
    calls = []
    timings = common.run_rounds(
        {"a": lambda: calls.append("a") or len(calls), "b": lambda: calls.append("b") or 0},
        rounds=3,
        warmup=1,
    )
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # order rotates every round
    assert len(timings["a"].times) == len(timings["b"].times) == 3
    assert timings["a"].first_result == 1 and timings["a"].peak_rss > 0
    with pytest.raises(ValueError, match="rounds >= 1"):
        common.run_rounds({"a": lambda: None}, rounds=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--d", "64", "--heads", "5"], "must divide"),
        (["--d", "64", "--rank", "65"], "at most min"),
        (["--steps", "0"], "positive integer"),
    ],
)
def test_bad_flags_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        adapter_step.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_one_curve_cell_table_and_plot(tmp_path):
    """One memory-curve cell in-process (two tiny blocks, int8 base), then the table and plot."""
    argv = ["--quick", "--cell", "lora-int8", "--depth", "2"]
    row = adapter_step.main(argv)
    assert row["method"] == "lora-int8" and row["depth"] == 2
    assert row["xla_temp_args"] > row["xla_temp"] > 0 and row["peak_rss"] > 0
    d, f, r = 64, 256, 8  # two blocks of LoRA state: factors + Adam's mu and nu (+ count)
    assert row["state_bytes"] == 2 * 12 * r * (8 * d + 2 * (d + f)) + 4
    rows = [row, {**row, "method": "full", "depth": 1}]
    table = adapter_step.curve_table(rows)
    assert table.splitlines()[0].startswith("| depth | method | step s")
    adapter_step.plot_curve(rows, str(tmp_path / "curve.png"), "test")
    assert (tmp_path / "curve.png").stat().st_size > 0


def _script(name: str):
    """An investigation script of ``docs/notes/scripts/`` (outside any package), as a module."""
    spec = importlib.util.spec_from_file_location(
        name, REPO / "docs" / "notes" / "scripts" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gemm_roles_floors():
    """``docs/notes/scripts/adapter_gemm_roles.py``: the LoRA step runs the six forwards and the
    input gradients of out, fc1 and fc2, 21 of the full step's 36 units of ``2·tokens·d²`` matmul
    FLOPs."""
    adapter_gemm_roles = _script("adapter_gemm_roles")

    result = adapter_gemm_roles.measure(tokens=32, d=8, rounds=1)
    assert result["flop_floor"] == pytest.approx(21 / 36, abs=1e-4)
    assert tuple(adapter_gemm_roles.PROJECTIONS) == adapter_step.TARGETS  # the benchmark's
    roles = {"forward", "input_grad", "weight_grad"}
    names = set(adapter_step.TARGETS)
    assert set(result["seconds"]) == {f"{n}/{r}" for n in names for r in roles}
    with pytest.raises(SystemExit):
        adapter_gemm_roles.main(["--rounds", "0"])
