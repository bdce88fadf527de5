"""The CASA experiment: config checks, and the smoke run end to end on the real MiniLM."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import pytest

from configs import casa as casa_config
from experiments import casa, common
from lowrank_jax import adapters, merging, models
from lowrank_jax.models.bert import split_encoder


def test_configs_pass_their_checks():
    for arg in (None, "smoke", "drift=away", "smoke,drift=away"):
        casa.check_config(casa_config.get_config(arg))
    away, toward = casa_config.get_config("drift=away"), casa_config.get_config()
    assert away.target.distill_weight == 0.0 < toward.target.distill_weight
    assert (
        away.target.steps * away.target.learning_rate
        > toward.target.steps * toward.target.learning_rate
    )
    with pytest.raises(ValueError, match="drift="):
        casa_config.get_config("drift=sideways")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("data.lora_plays", ("hamlet", "not_a_play"), "lora_plays"),
        ("model.first_layer", 6, "first_layer"),
        ("merge.ties", ((0.0, 1.0),), "merge.ties"),
        ("merge.casa", ((0.5, -1.0),), "merge.casa"),
        ("merge.rank", 0, "merge.rank"),
        ("merge.ties_trim", "per_layer", "ties_trim"),
    ],
)
def test_bad_values_are_named(key, value, match):
    config = casa_config.get_config("smoke")
    section, name = key.split(".")
    with config.unlocked():
        config[section][name] = value
    with pytest.raises(common.ConfigError, match=match):
        casa.check_config(config)


def _table(path):
    """``{method: {column: cell}}`` of a results.md table."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    out = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(header) and cells[0] in (*casa.METHODS, "target_alone"):
            out[cells[0]] = dict(zip(header, cells, strict=True))
    return out


def test_smoke_run_end_to_end(tmp_path, monkeypatch):
    config = casa_config.get_config("smoke")
    with config.unlocked():
        config.log.progress = False
    workdir = str(tmp_path)
    summary = casa.run(config, workdir)
    with open(os.path.join(workdir, "cells", "seed=0.json")) as f:
        cell = json.load(f)
    rows = cell["rows"]
    table = _table(os.path.join(workdir, "results.md"))
    assert set(table) == {*casa.METHODS, "target_alone"}
    assert os.path.exists(os.path.join(workdir, "transfer.png"))
    for method in casa.METHODS:
        row = rows[method]
        # every merge delivers an adapter of the stated rank; direct/revert/oracle are the LoRA's
        merges = ("task_arithmetic", "ties", "dare", "casa")
        want = config.merge.rank if method in merges else config.adapter.rank
        assert row["adapter_rank"] == want, method
        for k in ("play_accuracy", "genre_accuracy", "genre_agreement", "combined"):
            assert 0.0 <= row[k] <= 1.0, (method, k)
            # the table shows the (one-seed) result.json value, and the summary its mean
            assert float(table[method][k].split(" ± ")[0]) == pytest.approx(row[k], abs=5e-4)
            assert summary[f"{method}/{k}"] == pytest.approx(row[k], abs=1e-12)
        assert math.isfinite(row["norm_inflation"]) and row["norm_inflation"] > 0
        assert row["combined"] == pytest.approx(
            0.5 * (row["play_accuracy"] + row["genre_accuracy"])
        )
    # identities of the evaluation: source + LoRA is the norm reference, the target agrees with
    # itself, and the chosen hyper-parameters are candidates of the config
    assert rows["source_revert"]["norm_inflation"] == pytest.approx(1.0, abs=1e-6)
    assert rows["target_alone"]["genre_agreement"] == 1.0
    assert rows["direct"]["genre_agreement"] <= 1.0
    hp = rows["casa"]["hparams"]
    assert (hp["rotation_threshold"], hp["scale"]) in [tuple(c) for c in config.merge.casa]
    # resumable: a finished seed is read back, not recomputed; a run interrupted in its second
    # seed resumes there (the seeds are cells of experiments.common.sweep.CellStore)
    computed = []

    def fake_seed(config, seed, **kwargs):
        computed.append(seed)
        if len(computed) == 1:
            raise KeyboardInterrupt  # the interruption, inside seed 1
        return cell

    monkeypatch.setattr(casa, "_run_seed", fake_seed)
    assert casa.run(config, workdir) == summary and not computed
    with config.unlocked():
        config.num_seeds = 2
    with pytest.raises(KeyboardInterrupt):
        casa.run(config, workdir)
    assert not os.path.exists(os.path.join(workdir, "cells", "seed=1.json"))
    two = casa.run(config, workdir)  # seed 0 read back, seed 1 computed
    assert computed == [1, 1] and os.path.exists(os.path.join(workdir, "cells", "seed=1.json"))
    assert two["casa/combined"] == pytest.approx(summary["casa/combined"])  # seed 1 = seed 0


def test_casa_onto_the_source_itself_returns_the_lora_on_real_minilm_kernels():
    """CASA with target = source is the identity on ΔW (every cluster agrees with itself)."""
    config = casa_config.get_config("smoke")
    bert_config, variables, _ = models.load_minilm()
    _, _, top = split_encoder(bert_config, variables, config.model.first_layer)
    params = {"params": top}
    spec = adapters.lora(rank=config.adapter.rank, alpha=config.adapter.alpha)
    lora = adapters.init(jax.random.key(0), params, [(t, spec) for t in config.adapter.targets])
    keys = iter(jax.random.split(jax.random.key(1), 2 * len(lora)))
    lora = {  # random non-zero factors (LoRA's own init has B = 0, i.e. ΔW = 0)
        p: a.replace(
            factors=jax.tree.map(lambda f: 0.05 * jax.random.normal(next(keys), f.shape), a.factors)
        )
        for p, a in lora.items()
    }
    moved = merging.casa(params, params, lora, rank=config.merge.rank)
    assert set(moved) == set(lora)
    for path, ad in moved.items():
        assert ad.kind.rank == config.merge.rank
        got = np.asarray(adapters.delta(ad, ad.matrix), np.float64)
        want = np.asarray(adapters.delta(lora[path], ad.matrix), np.float64)
        assert np.linalg.norm(want) > 0.1
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
