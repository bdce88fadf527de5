"""The P13 SPR study end to end on a trimmed smoke config, its resume, and config checks."""

from __future__ import annotations

import json
from urllib.parse import quote

import numpy as np
import pytest
import scipy.stats

from configs import spr as cfg
from experiments import common, spr


def _tiny():
    config = cfg.get_config("smoke,methods=probe+map")
    config.schedule.pretrain_steps = 10
    config.schedule.prompt_steps = 5
    config.optim.learning_rates = (1e-2, 3e-2)
    return config


def test_smoke_run_writes_a_ci_table_and_resumes(tmp_path):
    config = _tiny()
    result = spr.run(config, str(tmp_path))
    for name in ("results.md", "summary.json", "f1_vs_missing_rate.png"):
        assert (tmp_path / name).exists(), name
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["method"]: r for r in summary["table"]}
    # probe:drop, the smoke config's drop ablation: the probe with missing tokens masked out.
    assert set(rows) == {"probe", "map", "probe:drop"} and result["rows"] == 3
    assert rows["probe"]["prompt_params"] == 0 and rows["map"]["prompt_params"] > 0
    for m in ("probe", "map", "probe:drop"):
        cells = [
            json.loads((tmp_path / "cells" / f"seed={s}%2F{quote(m)}.json").read_text())
            for s in (0, 1)
        ]
        for cell in cells:  # the chosen rate is the grid's best on validation
            valid = {float(k): v for k, v in cell["valid_f1"].items()}
            assert set(valid) == set(config.optim.learning_rates)
            assert valid[cell["learning_rate"]] == max(valid.values())
            assert all(0 <= cell[c] <= 1 for c in ("f1@0.5", "f1@0.9", "complete", "no_fou"))
        # The table's mean and 95% t-interval are those of the two seeds' cells.
        v = np.array([c["f1@0.7"] for c in cells])
        half = scipy.stats.t.ppf(0.975, 1) * v.std(ddof=1) / np.sqrt(2)
        assert rows[m]["f1@0.7"] == f"{v.mean():.3f} ± {half:.3f}"
    checks = {c["criterion"]: c for c in summary["checks"]}
    assert "probe: blank missing input ≥ dropped tokens (f1@0.7)" in checks
    again = spr.run(config, str(tmp_path))  # every cell read back, nothing retrained
    assert again == result


def test_bad_configs_fail_early_with_the_key():
    config = _tiny()
    config.missing.train_rate = 1.3
    with pytest.raises(common.ConfigError, match=r"config.missing.train_rate=1.3 is invalid"):
        spr.check_config(config)
    config = _tiny()
    config.missing.test_rates = (0.5, -0.1)
    with pytest.raises(common.ConfigError, match=r"missing.test_rates\[1\]=-0.1 is invalid"):
        spr.check_config(config)
    config = _tiny()
    config.data.views = ("fou", "audio")
    with pytest.raises(common.ConfigError, match="config.data.views=.*audio"):
        spr.check_config(config)
    config = _tiny()
    config.prompt.layers = 5
    with pytest.raises(common.ConfigError, match="config.prompt.layers=5 is invalid"):
        spr.check_config(config)
    config = _tiny()
    config.missing.drop_methods = ("maple",)
    with pytest.raises(common.ConfigError, match="config.missing.drop_methods=.*maple"):
        spr.check_config(config)
    with pytest.raises(common.ConfigError, match="methods='maple' is invalid"):
        cfg.get_config("methods=maple")


def test_paired_differences_cover_the_trend_steps_and_ablations():
    """The report's paired differences (per seed, 95% t-interval) for SPR − DCP-like, DCP-like −
    MAP, SPR − MAP and each ablation − SPR, computed from the cells."""
    from experiments.common import spr_report

    config = cfg.get_config("methods=probe+map+dcp+spr+spr-gif,drop=,seeds=3")
    rng = np.random.default_rng(0)
    cols = ("f1@0.5", "f1@0.7", "f1@0.9", "complete", "no_fou", "no_zer")
    cells = {
        f"seed={s}/{m}": {c: float(rng.uniform(0.6, 0.9)) for c in cols}
        for s in config.seeds
        for m in config.methods
    }
    out = spr_report.paired(config, cells)
    text = out["paired difference, trend steps and ablations (f1@0.9)"]
    v = np.array(
        [cells[f"seed={s}/spr"]["f1@0.9"] - cells[f"seed={s}/map"]["f1@0.9"] for s in (0, 1, 2)]
    )
    half = scipy.stats.t.ppf(0.975, 2) * v.std(ddof=1) / np.sqrt(3)
    want = f"spr {v.mean():+.3f} ± {half:.3f} (sd {v.std(ddof=1):.3f}) vs map"
    assert want in text
    for step in ("vs dcp", "dcp ", "spr-gif "):
        assert step in text
    assert "paired difference drop − blank (f1@0.7)" not in out
