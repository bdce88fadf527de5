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


def test_resolved_slope_uses_only_cells_well_above_the_floor():
    sizes = [100, 200, 400, 800, 1600]
    floor = 0.1
    errors = [floor + 0.8 * (n / 100) ** -0.5 for n in sizes]  # excess 0.8, 0.57, 0.4, 0.28, 0.2
    slope, used = report.resolved_slope(sizes, errors, floor, resolution=2.0)
    assert used == 5 and slope == pytest.approx(-0.5)
    # at resolution 4 only W₁ >= 0.4 counts: 100, 200 and 400 (the last with 0.5): 3 cells, 4x
    slope, used = report.resolved_slope(sizes, errors, floor, resolution=4.0)
    assert used == 3 and slope == pytest.approx(-0.5)
    # at 6 two cells are left: unresolved
    slope, used = report.resolved_slope(sizes, errors, floor, resolution=6.0)
    assert used == 2 and math.isnan(slope)
    # three cells spanning less than 4x in n: unresolved
    assert math.isnan(report.resolved_slope([100, 150, 200], [1.0, 0.9, 0.8], 0.1, 2.0)[0])


def test_the_resolve_config_runs_the_papers_estimator_and_reports_the_floor_beside_the_slope(
    tmp_path,
):
    config = cfg.get_config("smoke,resolve")
    assert config.eval.methods == ("diffusion", "empirical") and config.model.mlp_dims == ()
    assert config.eval.num_samples == 2 * cfg.get_config("smoke").eval.num_samples
    config.data.sources = ((2, 4), (2, 12))
    config.data.sizes = (10, 20, 40)
    config.model.num_steps = 8
    config.eval.num_samples = 80
    config.eval.resolution = 1.0  # every cell above the floor counts: a slope on each seed
    result = subspace_diffusion.run(config, str(tmp_path))
    rows = {(r["source"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(f"syn-k2-D{d}", m) for d in (4, 12) for m in config.eval.methods}
    for r in rows.values():
        assert r["floor"] > 0 and r["w1_over_floor"] > 0 and r["resolved_points"] <= 3
    assert result["mlp"] == []
    with open(tmp_path / "cells" / "syn-k2-D4-n10-s0.json") as f:
        assert {k for k in json.load(f) if k.startswith("w1_")} == {"w1_diffusion", "w1_empirical"}
    criteria = [c["criterion"] for c in result["checks"]]
    assert any("on the resolved cells" in c for c in criteria)
    assert any("slope at D=12 vs D=4" in c for c in criteria)
    assert not any("KDE" in c or c.startswith("mlp") for c in criteria)
    text = (tmp_path / "results.md").read_text()
    assert "slope_resolved" in text and "w1_over_floor" in text and "DSM-MLP" not in text
    config.eval.methods = ("diffusion",)
    with pytest.raises(common.ConfigError, match="holding 'empirical'"):
        subspace_diffusion.check_config(config)
