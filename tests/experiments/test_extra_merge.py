"""The Extra-Merge experiment end to end (smoke), its orbax reader, and the merge benchmark."""

import json
import os

import jax
import numpy as np
import pytest

from configs import extra_merge as extra_merge_config
from experiments import extra_merge
from experiments.bench import merge as bench_merge
from experiments.common.checkpoint_reader import CheckpointSequence, saved_steps
from lowrank_jax import merging


def test_smoke_run_writes_tables_and_merges_saved_checkpoints(tmp_path, monkeypatch):
    config = extra_merge_config.get_config("smoke")
    config.log.progress = False
    config.ckpt.keep_runs = True
    config.optim.names = ("adamw",)  # Muon runs in colabs/05_merging.ipynb (suite time)
    out = extra_merge.run(config, str(tmp_path))
    for name in ("results.md", "results.json", "loss_vs_alpha_adamw.png"):
        assert os.path.exists(tmp_path / name), name
    assert [r["optimizer"] for r in out["rows"]] == ["adamw"]
    with open(tmp_path / "cells" / "adamw_s0.json") as f:
        cell = json.load(f)
    assert set(cell["test"]) == set(extra_merge.METHODS)
    assert 0.0 <= cell["rho1_W1"] <= 1.0 and cell["sketch_exact"] is True  # P <= 65,536
    # Extra-Merge at α = 0 is M_N, the LAWA merge over its window.
    curve = cell["alpha_curves"]["3"]
    assert curve["alpha"][0] == 0.0 and np.isclose(curve["valid_loss"][0], cell["lawa_valid"]["3"])
    # The orbax reader gives back the 8 window checkpoints, and they merge like in-memory ones.
    ckpt_dir = tmp_path / "runs" / "adamw_s0" / "const" / "checkpoints"
    steps = saved_steps(ckpt_dir)
    assert len(steps) == config.schedule.num_checkpoints + 1 and steps[-1] == 60
    lazy = CheckpointSequence(ckpt_dir, steps=steps[1:])
    eager = [lazy[i] for i in range(len(lazy))]
    a = merging.lawa(lazy, window=3)
    b = merging.lawa(eager, window=3)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), a, b)
    with pytest.raises(ValueError, match="not saved"):
        CheckpointSequence(ckpt_dir, steps=[7])
    # A rerun reads the finished cells back (experiments.common.sweep.CellStore); a run
    # interrupted in its second cell resumes there.
    computed = []

    def fake_cell(config, model, arrays, name, seed, root, options):
        computed.append((name, seed))
        if len(computed) == 1:
            raise KeyboardInterrupt  # the interruption, inside (adamw, seed 1)
        return {**cell, "seed": seed}

    monkeypatch.setattr(extra_merge, "_cell", fake_cell)
    assert extra_merge.run(config, str(tmp_path))["rows"] == out["rows"] and not computed
    config.num_seeds = 2
    with pytest.raises(KeyboardInterrupt):
        extra_merge.run(config, str(tmp_path))
    assert not (tmp_path / "cells" / "adamw_s1.json").exists()
    two = extra_merge.run(config, str(tmp_path))
    assert (
        computed == [("adamw", 1), ("adamw", 1)] and (tmp_path / "cells" / "adamw_s1.json").exists()
    )
    assert two["rows"][0]["last"].split(" ± ")[0] == out["rows"][0]["last"].split(" ± ")[0]


def test_bench_tiny_prints_the_json_line(capsys):
    out = bench_merge.main(["--tiny", "--num_checkpoints", "6", "--window", "2", "--rounds", "1"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == out
    for k in ("extra_merge_vs_lawa_time", "extra_merge_peak_rss_mb", "naive_peak_rss_mb"):
        assert last[k] is not None and last[k] > 0
    # The tiny tree fits the sketch, so streaming and stacking agree.
    assert abs(last["extra_merge_rho1"] - last["naive_rho1"]) < 1e-5
    assert last["max_rel_fingerprint_diff_vs_naive"] < 1e-4
