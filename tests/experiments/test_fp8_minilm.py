"""The pretrained-MiniLM FP8 check (P14) on real text, smoke size: the bound holds in every head."""

import json

import pytest

from configs.fp8_minilm import get_config
from experiments import common, fp8_minilm


def test_smoke_run_bounds_hold_on_minilm(tmp_path):
    pytest.importorskip("tokenizers")
    config = get_config("smoke")
    try:
        result = fp8_minilm.run(config, str(tmp_path))
    except (FileNotFoundError, ModuleNotFoundError) as e:  # the MiniLM data package is missing
        pytest.skip(f"MiniLM not installed: {e}")
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 6  # one per layer
    for r in rows:
        # the empirical max logit is below the deterministic worst case, and the rank-aware bound
        # is tighter than the rank-agnostic one, which is tighter than the worst case
        assert r["max abs(S) (text)"] <= r["B_wc"]
        assert r["rank-aware bound"] < r["rank-agnostic bound"] < r["B_wc"]
    # P14's claim on real weights and text: no head overflows at the geometry-aware scale
    assert 0 < result["max_ratio"] < 1 and result["overflowing_heads"] == 0


def test_config_validation():
    config = get_config("smoke")
    config.policy.delta = 1.5
    with pytest.raises(common.ConfigError):
        fp8_minilm.check_config(config)
