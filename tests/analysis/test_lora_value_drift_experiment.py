"""P3 (c) end to end in smoke mode: a value-only LoRA on MiniLM, then per-head gap ratios vs drift.

One run only (no resume check: ``fit`` and ``CellStore`` resumption are tested elsewhere).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import lora_value_drift as p3c_config
from experiments import lora_value_drift as p3c_exp
from experiments.common import ConfigError


def test_lora_value_drift_smoke_runs(tmp_path):
    c = p3c_config.get_config("smoke")
    m = p3c_exp.run(c, str(tmp_path))
    assert m["heads"] == 12  # the 12 heads of layer 5, the smoke's only adapted layer
    for name in (
        "results.md",
        "heads.json",
        "drift_vs_ratio.png",
        "sweep.png",
        "finetune/results.md",
    ):
        assert (tmp_path / name).exists(), name
    heads = json.loads((tmp_path / "heads.json").read_text())
    ratio = np.asarray([h["ratio"] for h in heads])
    np.testing.assert_allclose(ratio, [h["delta_norm"] / h["gap"] for h in heads], rtol=1e-5)
    assert all(h["drift_relative"] > 0 for h in heads)  # a trained adapter moves every head
    cells = sorted((tmp_path / "cells").glob("*.json"))
    names = {p.name.split("%2F")[0] for p in cells}  # layer 5, joint, its swept head (+ flip)
    assert (
        {"joint.json", "layer=5.json", "sweep"}
        <= names
        <= {"joint.json", "layer=5.json", "sweep", "flip"}
    )
    joint = json.loads(next(p for p in cells if "joint" in p.name).read_text())
    rel = [d["relative"] for d in joint["drift"]]
    assert rel[0] < rel[1] < rel[2]  # the whole adapter scaled by 0.5, 1, 2


def test_lora_value_drift_config_errors():
    c = p3c_config.get_config("smoke")
    with c.unlocked():
        c.heldout.plays = (c.finetune.data.plays[0],)
    with pytest.raises(ConfigError, match="disjoint"):
        p3c_exp.check_config(c)
    c = p3c_config.get_config("smoke")
    with c.unlocked():
        c.finetune.adapter.targets = (r".*/attention/query/kernel",)
    with pytest.raises(ConfigError, match="value"):
        p3c_exp.check_config(c)
