"""The P7 experiment end to end through ``run`` on a trimmed smoke config, and its config checks."""

import json
import math
import os

import pytest

from configs import subspace_diffusion as cfg
from experiments import common, subspace_diffusion
from experiments import subspace_diffusion_report as report


def _tiny():
    config = cfg.get_config("smoke")
    config.data.sources = ((2, 4), (2, 12))
    config.data.sizes = (20, 40)
    config.data.valid_size = 40
    config.model.num_steps = 8
    config.model.kde_bandwidths = 4
    config.model.mlp_n = 20
    config.model.mlp_dims = (4, 12)
    config.model.mlp_features = (16,)
    config.schedule.mlp_steps = 4
    config.schedule.batch_size = 8
    config.eval.num_samples = 60
    config.log.every = 2
    return config


def test_smoke_run_writes_outputs_and_resumes(tmp_path):
    config = _tiny()
    result = subspace_diffusion.run(config, str(tmp_path))
    for name in ("config.json", "results.md", "results.json", "w1_vs_n.png", "samples.png"):
        assert os.path.exists(tmp_path / name), name
    assert result["cells"] == 2 * 2 * 2  # sources x sizes x seeds
    rows = {(r["source"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(f"syn-k2-D{d}", m) for d in (4, 12) for m in report.METHODS}
    for r in rows.values():
        assert r["w1_n_max"] > 0 and r["floor"] > 0 and r["target"] == -0.5
        assert math.isfinite(r["slope"]) and r["slope_sd"] >= 0
    # the noisy sample at t0 keeps D-dimensional noise that the Tweedie step removes
    by_d = {r["D"]: r for r in result["by_dimension"]}
    assert set(by_d) == {4, 12}
    assert by_d[12]["diffusion_no_tweedie"] > by_d[12]["diffusion"]
    assert by_d[12]["mlp"] > 0 and by_d[12]["mlp_sd"] >= 0
    statuses = {c["status"] for c in result["checks"]}
    assert report.BY_CONSTRUCTION in statuses
    mlp = result["mlp"]
    assert len(mlp) == 2 * config.eval.num_seeds  # two D, every seed
    assert all(r["lr"] in config.model.mlp_learning_rates for r in mlp)
    text = (tmp_path / "results.md").read_text()
    assert "slope_excess" in text and "by construction" in text and "DSM-MLP" in text
    with open(tmp_path / "results.json") as f:
        assert json.load(f)["mlp"][0]["w1_mlp"] > 0
    again = subspace_diffusion.run(config, str(tmp_path))  # reads the finished cells back
    assert again["rows"] == result["rows"]


def test_config_checks():
    config = _tiny()
    config.data.sources = ((5, 4),)
    with pytest.raises(common.ConfigError, match="exceeds D"):
        subspace_diffusion.check_config(config)
    config = _tiny()
    config.data.laws = ("uniform", "gauss", "laplace")
    with pytest.raises(common.ConfigError, match="allowed"):
        subspace_diffusion.check_config(config)
    config = _tiny()
    config.data.sizes = (20,)
    with pytest.raises(common.ConfigError, match="slope"):
        subspace_diffusion.check_config(config)
    config = _tiny()
    config.model.mlp_dims = (4, 50)
    with pytest.raises(common.ConfigError, match="not in sources"):
        subspace_diffusion.check_config(config)
    config = _tiny()
    config.model.mlp_n = 30
    with pytest.raises(common.ConfigError, match="one of data.sizes"):
        subspace_diffusion.check_config(config)
