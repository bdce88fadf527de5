"""The P15 LoRA-BO study end to end on its smoke config, its resume, and config checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from configs import lora_bo as cfg
from experiments import common, lora_bo


def test_smoke_run_writes_results_and_reruns_from_the_cache(tmp_path):
    config = cfg.get_config("smoke")
    config.log.progress = False
    result = lora_bo.run(config, str(tmp_path))
    for name in ("results.md", "summary.json", "regret.png", "scores.npz", "minilm.npz"):
        assert (tmp_path / name).exists(), name
    with np.load(tmp_path / "scores.npz") as f:
        full, proxy = f["full_valid"], f["proxy_valid"]
    assert full.shape == proxy.shape == (8,)
    assert np.all((full >= 0) & (full <= 1))
    rho = stats.spearmanr(proxy, full).statistic
    assert result["spearman_proxy_full"] == pytest.approx(rho, abs=1e-4)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["method"]: r for r in summary["table"]}
    assert set(rows) == set(config.search.methods)
    for r in rows.values():  # regrets are measured against the table's optimum
        assert 0 <= r["median regret @B"] <= proxy.max() - proxy.min() + 1e-9
    cell = json.loads((tmp_path / "cells" / "search%2Frandom%2Fseed=0.json").read_text())
    np.testing.assert_allclose(cell["values"], proxy[cell["indices"]], atol=1e-6)
    # "best vs default" is judged on the configuration BO picked (best searched validation
    # score among its evaluations), trained in full, not on the grid optimum.
    with np.load(tmp_path / "scores.npz") as f:
        test, default = f["full_test"], float(f["default_test"])
    picks = []
    for s in range(config.search.num_seeds):
        c = json.loads((tmp_path / "cells" / f"search%2Fbo_minilm%2Fseed={s}.json").read_text())
        picks.append(c["indices"][int(np.argmax(c["values"]))])
    assert result["checked_searcher"] == "bo_minilm"
    assert result["pick_median_test_accuracy"] == pytest.approx(np.median(test[picks]), abs=1e-4)
    gain = np.median(test[picks]) - default
    assert result["pick_median_gain_over_default"] == pytest.approx(gain, abs=1e-4)
    check = next(c for c in summary["checks"] if "pick beats the default" in c["criterion"])
    assert check["reproduced"] == bool(gain >= config.eval.clear_margin)
    assert lora_bo.run(config, str(tmp_path)) == result  # every cell and table read back


def test_bad_configs_fail_early_with_the_key():
    config = cfg.get_config("smoke")
    config.search.methods = ("bo_gpt",)
    with pytest.raises(common.ConfigError, match="unknown 'bo_gpt'"):
        lora_bo.check_config(config)
    config = cfg.get_config("smoke")
    config.search.budget = 9
    with pytest.raises(common.ConfigError, match="budget exceeds"):
        lora_bo.check_config(config)
    config = cfg.get_config("smoke")
    config.optim.batch_sizes = (8, 12)
    with pytest.raises(common.ConfigError, match="multiples of optim.micro_batch"):
        lora_bo.check_config(config)
