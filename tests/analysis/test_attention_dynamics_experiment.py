"""The P3 experiment runs end to end in smoke mode (synthetic grid + one MiniLM head) and resumes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import attention_dynamics as p3_config
from experiments import attention_dynamics as p3_exp
from experiments.common import ConfigError


def test_attention_dynamics_smoke_runs_and_resumes(tmp_path):
    c = p3_config.get_config("smoke")
    m = p3_exp.run(c, str(tmp_path))
    assert m["rows"] == len(p3_exp.DIRECTIONS) and m["minilm_heads"] == 1
    for name in ("results.md", "heatmap_sphere_d3_g0.2.png", "minilm_dfinal.png", "minilm.json"):
        assert (tmp_path / name).exists(), name
    cells = sorted((tmp_path / "cells").glob("**/*.json"))
    assert len(cells) == 2
    for path in cells:
        cell = json.loads(path.read_text())
        d_final, w2 = np.asarray(cell["d_final"]), np.asarray(cell["w2_final"])
        # W2 between the final measures never exceeds the largest token displacement.
        assert np.all(w2 <= d_final * (1 + 1e-5) + 1e-6)
        assert np.all(np.asarray(cell["d_max"]) >= d_final - 1e-9)
    assert p3_exp.run(c, str(tmp_path)) == m  # finished cells are reused


def test_attention_dynamics_config_errors():
    c = p3_config.get_config("smoke")
    with c.unlocked():
        c.data.models = ("torus",)
    with pytest.raises(ConfigError, match="sphere"):
        p3_exp.check_config(c)
