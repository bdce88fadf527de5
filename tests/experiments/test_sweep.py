"""The shared sweep helper: resumable cells, the scan and epoch trainers, mean ± sd, tables."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import common
from experiments.common import sweep


def _aggregate(store, keys_and_values):
    """A small sweep: 3 methods x 4 seeds, reported as mean ± sd per method."""
    rows = {}
    for method, seeds in keys_and_values.items():
        res = [
            store.get(f"{method}/lr=0.1/seed={s}", lambda v=v: {"accuracy": v, "tag": "x"})
            for s, v in enumerate(seeds)
        ]
        rows[method] = sweep.format_mean_sd([r["accuracy"] for r in res], 4)
    return rows


def test_cell_store_resumes_without_recomputing_and_gives_identical_aggregates(tmp_path):
    rng = np.random.default_rng(0)
    values = {m: rng.random(4).astype(np.float32).tolist() for m in ("a", "b@64", "c/x")}
    first = sweep.CellStore(tmp_path)
    table = _aggregate(first, values)
    first.close()
    assert len(first.computed) == 12
    files = os.listdir(tmp_path / "cells")
    assert len(files) == 12 and all(f.endswith(".json") for f in files)  # atomic: no .tmp left
    assert os.path.exists(first.path("c/x/lr=0.1/seed=3"))  # '/' in keys does not make folders

    def fail():
        raise AssertionError("a finished cell was recomputed")

    again = sweep.CellStore(tmp_path)
    assert "b@64/lr=0.1/seed=2" in again
    assert again.get("b@64/lr=0.1/seed=2", fail)["accuracy"] == values["b@64"][2]
    rows = {}
    for m, seeds in values.items():
        res = [again.get(f"{m}/lr=0.1/seed={s}", fail) for s in range(len(seeds))]
        rows[m] = sweep.format_mean_sd([r["accuracy"] for r in res], 4)
    assert rows == table and again.computed == []
    # One metrics.jsonl record per computed cell.
    records = common.read_metrics(tmp_path)
    assert len(records) == 12 and records[0]["a/lr=0.1/seed=0/accuracy"] == values["a"][0]
    # resume=False recomputes (and overwrites) the cell.
    fresh = sweep.CellStore(tmp_path, resume=False, log_metrics=False)
    assert fresh.get("a/lr=0.1/seed=0", lambda: {"accuracy": 2.0})["accuracy"] == 2.0
    with open(fresh.path("a/lr=0.1/seed=0")) as f:
        assert json.load(f) == {"accuracy": 2.0}


def test_cell_store_returns_what_a_rerun_reads(tmp_path):
    store = sweep.CellStore(tmp_path, log_metrics=False)
    out = store.get("k", lambda: {"ranks": (1, 2), "x": np.float32(0.5).item()})
    assert out == {"ranks": [1, 2], "x": 0.5}  # JSON round trip: the same on every run
    assert sweep.CellStore(tmp_path, log_metrics=False).get("k", dict) == out


@pytest.mark.parametrize("n", [1, 2, 7])
def test_mean_sd_equals_numpy(n):
    v = np.random.default_rng(n).standard_normal(n) * 3 + 1
    m, s = sweep.mean_sd(list(v))
    assert m == pytest.approx(np.mean(v), abs=1e-12)
    assert s == pytest.approx(np.std(v, ddof=1) if n > 1 else 0.0, abs=1e-12)
    assert (
        sweep.format_mean_sd(v, 2)
        == f"{np.mean(v):.2f} ± {(np.std(v, ddof=1) if n > 1 else 0):.2f}"
    )
    with pytest.raises(ValueError, match="at least one"):
        sweep.mean_sd([])


def test_batch_indices_are_successive_permutations():
    idx = sweep.batch_indices(0, 10, 3, 9)  # 3 batches per epoch; epochs of 9 of 10 examples
    assert idx.shape == (9, 3)
    flat = idx.reshape(-1)
    for e in range(2):
        assert len(set(flat[10 * e : 10 * e + 10])) == 10
    np.testing.assert_array_equal(idx, sweep.batch_indices(0, 10, 3, 9))


def _loss(w, x0, batch):
    return jnp.mean((batch["x"] @ w + x0 - batch["y"]) ** 2)


def test_train_scan_matches_a_float64_python_loop():
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((12, 3)), "y": rng.standard_normal(12)}
    idx = sweep.batch_indices(1, 12, 4, 7)
    lr = 0.1
    w0 = np.zeros(3)
    p, state, trace = sweep.train_scan(
        jnp.asarray(w0, jnp.float32), 0.5,
        jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), data), idx,
        loss_fn=_loss, tx=optax.sgd(lr),
    )  # fmt: skip
    w, ref_trace = w0.copy(), []
    for i in idx:  # SGD on the batch mean-squared error, float64
        x, y = data["x"][i], data["y"][i]
        w -= lr * 2 * x.T @ (x @ w + 0.5 - y) / len(y)
        ref_trace.append(np.mean((data["x"] @ w + 0.5 - data["y"]) ** 2))
    np.testing.assert_allclose(p, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trace, ref_trace, rtol=1e-5)
    p2, _, none = sweep.train_scan(
        jnp.asarray(w0, jnp.float32), 0.5,
        jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), data), idx,
        loss_fn=_loss, tx=optax.sgd(lr), trace=False,
    )  # fmt: skip
    assert none is None
    np.testing.assert_array_equal(p, p2)  # the trace does not change the training
    assert sweep.adam(1e-3) is sweep.adam(1e-3)


def test_train_epochs_splits_the_key_and_logs_every_k():
    seen = []

    def epoch(p, s, key, x):
        seen.append(key)
        return p + x, s, p

    p, s, curve = sweep.train_epochs(
        epoch, 0.0, None, jax.random.key(3), 1.0, num_epochs=5, log_every=2
    )
    assert p == 5.0 and curve == [(2, 1.0), (4, 3.0), (5, 4.0)]
    k = jax.random.key(3)
    for got in seen:
        k, want = jax.random.split(k)
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))


def test_tables_and_results(tmp_path):
    text = sweep.markdown_table(
        [{"a": 1.23456, "b": True}, {"a": float("inf"), "b": False}], [("A", "a"), ("B", "b")]
    )
    assert text.splitlines() == ["| A | B |", "|---|---|", "| 1.235 | yes |", "| inf | **no** |"]
    checks = [sweep.check("trend holds", True), sweep.check("ratio", 4.5, "L2/L8")]
    table = [{"method": "x", "acc": "0.5 ± 0.1"}]
    out = sweep.write_sweep_results(
        tmp_path, table, checks, title="T", columns=["method", "acc"], command="cmd",
        extra={"source_accuracy": 0.99},
    )  # fmt: skip
    assert out == {"rows": 1, "trend holds": True, "ratio": 4.5, "source_accuracy": 0.99}
    md = (tmp_path / "results.md").read_text()
    assert (
        "Command: `cmd`" in md and "| trend holds | yes |" in md and "| ratio | 4.5 | L2/L8 |" in md
    )
    assert json.loads((tmp_path / "summary.json").read_text())["checks"][1]["evidence"] == "L2/L8"
    assert sweep.command_line("default") == "default"  # not run through experiments.train


def test_check_config_names_the_bad_key():
    from configs import sbvi as sbvi_config

    config = sbvi_config.get_config("smoke")
    sweep.check_config(config)
    config.eval.num_seeds = 0
    with pytest.raises(common.ConfigError, match="eval.num_seeds"):
        sweep.check_config(config)


def test_a_diverged_cell_stays_nan_after_resume(tmp_path):
    sweep.CellStore(tmp_path, log_metrics=False).get("bad", lambda: {"loss": float("nan")})
    again = sweep.CellStore(tmp_path, log_metrics=False).get("bad", dict)
    assert np.isnan(again["loss"]) and np.isnan(sweep.mean_sd([again["loss"], 1.0])[0])
