"""The KGE experiment end to end through ``run`` on a trimmed smoke config."""

import json
import os

from configs import kge as kge_config
from experiments import kge


def test_kge_smoke_run_writes_outputs(tmp_path):
    config = kge_config.get_config("smoke")
    # trimmed further to keep the suite fast: one dimension, short training, 4 cells
    config.model.dims = (2,)
    config.model.baselines = ("matched",)
    config.schedule.epochs = 6
    config.log.every = 3
    config.data.synthetic_densities = (0.3,)
    result = kge.run(config, str(tmp_path))
    for name in ("config.json", "metrics.jsonl", "results.md", "results.json", "synthetic_fit.png"):
        assert os.path.exists(tmp_path / name), name
    assert "fit_mrr_nations_distmult.png" in result["plots"]
    n_cells = len(os.listdir(tmp_path / "cells"))
    assert result["cells"] == n_cells == 2 + 1 + 1
    text = (tmp_path / "results.md").read_text()
    assert "Trend checks" in text and "necessary dimension" in text
    with open(tmp_path / "results.json") as f:
        saved = json.load(f)
    row = next(r for r in saved["results"] if r["kind"] == "mos")
    assert 0.0 < row["train_mrr"] <= 1.0 and row["train_nll"] > 0.0
    # resuming reads the finished cells back
    again = kge.run(config, str(tmp_path))
    assert again["checks"] == result["checks"]
