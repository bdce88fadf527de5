"""The MiniLM fine-tuning experiment: what each method trains, and a smoke run end to end."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from configs import lora_finetune as lora_config
from experiments import common, lora_finetune
from lowrank_jax import adapters
from lowrank_jax.adapters.finetune import trained_parts
from lowrank_jax.adapters.paths import named_leaves

# all-MiniLM-L6-v2: 6 layers, d = 384, MLP width 1536; 3 genres.
D, FF, LAYERS, RANK, CLASSES = 384, 1536, 6, 8, 3
HEAD = D * CLASSES + CLASSES
BASE = 22_713_216
LORA = LAYERS * (4 * RANK * (D + D) + 2 * RANK * (D + FF))


@pytest.fixture(scope="module")
def minilm():
    config = lora_config.get_config("smoke")
    return lora_finetune._build_model(config, CLASSES, jax.random.key(0))


def _leaves_by_path(tree):
    return set(named_leaves(tree))


@pytest.mark.parametrize(
    ("method", "trained"), [("lora", LORA + HEAD), ("head", HEAD), ("full", BASE + HEAD)]
)
def test_each_method_trains_what_it_says(minilm, method, trained):
    model, variables = minilm
    config = lora_config.get_config(f"smoke,method={method}")
    state, frozen, _, _ = lora_finetune.init_state(config, model, variables, jax.random.key(1))
    assert adapters.count_params(trained_parts(state)) == trained
    params = _leaves_by_path(state["params"])
    if method == "full":
        assert frozen is None and len(params) == len(_leaves_by_path(variables))
    else:
        assert params == {"params/head/kernel", "params/head/bias"}
        assert _leaves_by_path(frozen) == _leaves_by_path(variables) - params
    if method == "lora":
        assert len(state["adapters"]) == LAYERS * 6  # q, k, v, out, fc1, fc2 of every layer


def test_lora_starts_at_the_pretrained_model(minilm):
    model, variables = minilm
    config = lora_config.get_config("smoke")
    state, frozen, logits_fn, _ = lora_finetune.init_state(
        config, model, variables, jax.random.key(1)
    )
    texts = ["Now is the winter of our discontent", "If music be the food of love, play on"]
    from lowrank_jax import models

    _, _, tokenizer = models.load_minilm()
    batch = models.tokenize(tokenizer, texts, max_len=16)
    ours = jax.jit(lambda s, f, b: logits_fn(s, f, b, train=False, key=None))(state, frozen, batch)
    base = model.apply(variables, batch["input_ids"], batch["attention_mask"])
    np.testing.assert_allclose(ours, base, atol=1e-6)


def test_smoke_run_end_to_end(tmp_path):
    config = lora_config.get_config("smoke")
    config.schedule.num_steps = 4
    config.ckpt.every = 2
    config.log.every = 2
    config.log.progress = False
    metrics = lora_finetune.run(config, str(tmp_path))
    assert metrics["steps"] == 4 and not metrics["interrupted"]
    assert metrics["trainable_params"] == LORA + HEAD
    assert metrics["total_params"] == BASE + HEAD
    assert 0.0 <= metrics["test/accuracy"] <= 1.0 and np.isfinite(metrics["test/loss"])
    assert metrics["step_time_s"] > 0
    # The checkpoint holds the factors, the head and their Adam moments, not the frozen 22.7M.
    state_dir = tmp_path / "checkpoints" / "4" / "state"
    size = sum(p.stat().st_size for p in state_dir.rglob("*") if p.is_file())
    assert size < 3 * 4 * (LORA + HEAD) + 2_000_000 < 4 * BASE
    assert "| lora | 332,931 |" in (tmp_path / "results.md").read_text()
    assert [r["step"] for r in common.read_metrics(tmp_path) if "train/loss" in r] == [2, 4]


def test_frameft_kind_trains_coefficients_at_their_own_learning_rate(minilm):
    """``kind=frameft`` (``configs/frameft.py:minilm``): FrameFT on the same 36 kernels, with the
    coefficients' peak learning rate 50x the head's."""
    model, variables = minilm
    config = lora_config.get_config("smoke,kind=frameft")
    lora_finetune.check_config(config)
    state, _, _, tx = lora_finetune.init_state(config, model, variables, jax.random.key(0))
    assert adapters.count_params(state["adapters"]) == 6 * 6 * 921
    assert {type(a.kind).__name__ for a in state["adapters"].values()} == {"FrameFT"}
    trained = {"params": state["params"], "adapters": state["adapters"]}
    grads = jax.tree.map(lambda x: 1e-3 * np.ones_like(x), trained)
    opt_state = state["opt_state"]
    for _ in range(2):  # the first step has a zero learning rate (warmup from 0)
        updates, opt_state = tx.update(grads, opt_state, trained)
    head = np.asarray(updates["params"]["params"]["head"]["bias"])
    coeffs = np.asarray(next(iter(updates["adapters"].values())).factors["coeffs"])
    np.testing.assert_allclose(coeffs.mean() / head.mean(), 5e-2 / 1e-3, rtol=1e-4)
