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
    rows = {r["kind"]: r for r in saved["results"] if r["group"] != "synthetic"}
    for kind, row in rows.items():  # rank metrics consistent with their definitions
        e = saved["graphs"][row["dataset"]]["entities"]
        for split in ("train", "test"):
            h1, h10, mrr = (row[f"{split}_{k}"] for k in ("hits@1", "hits@10", "mrr"))
            # a rank-1 object adds 1 to the MRR, any other at least 1/E; a rank > 10 less than
            # 1/10 (an off-by-one rank, 1/(rank+1), or a mean rank breaks these)
            assert 0 <= h1 <= h10 <= 1, (kind, split)
            assert h1 + (1 - h1) / e - 1e-6 <= mrr <= h10 + (1 - h10) / 10 + 1e-6, (kind, split)
        assert row["train_nll"] > 0 and row["test_nll"] > 0
    # the "matched" baseline is a linear softmax with MoS(d, K)'s parameter count, up to one
    # embedding dimension of rounding (E + 2R parameters)
    mos, matched = rows["mos"], rows["matched"]
    stats = saved["graphs"][mos["dataset"]]
    per_dim = stats["entities"] + 2 * stats["relations"]
    assert matched["d"] > mos["d"] and abs(matched["params"] - mos["params"]) <= per_dim
    # resuming reads the finished cells back
    again = kge.run(config, str(tmp_path))
    assert again["checks"] == result["checks"]
