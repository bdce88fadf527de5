"""The PEFT studies (FrameFT P10, LoRA-DA P6, SBVI P8): data, teacher ranks, cells, resume."""

from __future__ import annotations

import os

import numpy as np

from configs import frameft as frameft_config
from configs import lora_da as lora_da_config
from configs import sbvi as sbvi_config
from experiments import common, frameft, lora_da, sbvi
from experiments.common import digits_shift, sweep


def _tiny(config, **overrides):
    with config.unlocked():
        for path, value in overrides.items():
            node = config
            *parents, leaf = path.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = value
    return config


def test_shifted_digits_rotate_and_keep_labels():
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 8, 8, 1) / 128
    out = digits_shift.shifted_digits(x, noise=0.0, seed=0)
    np.testing.assert_array_equal(out[0, :, :, 0], np.rot90(x[0, :, :, 0]))
    noisy = digits_shift.shifted_digits(x, noise=0.2, seed=0)
    assert 0.1 < np.mean(noisy != out) < 0.3
    src, tr, va, te = digits_shift.digits_domains(0, num_train=30, noise=0.2, num_valid=10)
    assert len(tr[1]) == 30 and len(va[1]) == 10 and len(te[1]) + 40 == 719
    assert len(src[1]) + 719 == 1797


def test_teacher_student_has_the_true_ranks():
    config = sbvi_config.get_config("smoke")
    _, teacher, target, (x, y), _ = sbvi.teacher_student(config, 0)
    for name, k in zip(("dense_0", "dense_1", "head"), config.data.true_ranks, strict=True):
        d = np.asarray(target["params"][name]["kernel"]) - np.asarray(
            teacher["params"][name]["kernel"]
        )
        s = np.linalg.svd(d, compute_uv=False)
        assert np.sum(s > 1e-4 * s[0]) == k
    assert x.shape == (2000, 64) and y.shape == (2000, 10)


def test_sbvi_cell_reports_ranks_and_state(tmp_path):
    config = _tiny(sbvi_config.get_config("smoke"), **{"schedule.num_steps": 20})
    options = common.TrainOptions.from_config(config)
    cell = sbvi.run_cell(config, "sbvi", 0, options=options)
    assert len(cell["ranks"]) == 3 and all(0 <= r <= 16 for r in cell["ranks"])
    ada = sbvi.run_cell(config, "adalora", 0, options=options)
    assert cell["params"] == ada["params"] and cell["opt_state"] < ada["opt_state"]
    lora = sbvi.run_cell(config, "lora_r4", 0, options=options)  # numeric ranks of ΔW (matrix)
    assert (
        all(1 <= r <= 4 for r in lora["ranks"]) and len(lora["spectra"]["params/head/kernel"]) == 10
    )


def test_frameft_cell_counts_parameters_and_flops():
    config = _tiny(
        frameft_config.get_config("smoke"), **{"schedule.num_steps": 3, "model.pretrain_steps": 20}
    )
    rows = {name: make for name, _, make in frameft.methods(config)}
    options = common.TrainOptions.from_config(config)
    out = frameft.run_cell(config, rows["frameft_L8@64"], 1e-2, 0, valid=True, options=options)
    assert out["params"] == 2 * 64
    # the accuracy is a count over the validation split (a bug that scored the test split, or a
    # padded batch, would have another denominator)
    n_valid = config.data.num_valid
    assert abs(out["accuracy"] * n_valid - round(out["accuracy"] * n_valid)) < 1e-3
    # the 128 coefficients train: the last step's loss is below the same run's at lr = 0 (a bug
    # that cut the gradient to the coefficients would make them equal)
    frozen = frameft.run_cell(config, rows["frameft_L8@64"], 0.0, 0, valid=True, options=options)
    assert out["final_train_loss"] < frozen["final_train_loss"] - 1e-3
    spec = rows["frameft_L8@64"]()  # ΔW FLOPs over the two hidden kernels (64x256, 256x256)
    assert out["delta_flops"] == spec.delta_flops(64, 256) + spec.delta_flops(256, 256)


def test_lora_da_run_writes_tables_and_resumes(tmp_path):
    config = _tiny(
        lora_da_config.get_config("smoke"),
        **{
            "schedule.num_steps": 12,
            "eval.loss_steps": (10, 12),
            "adapter.ranks": (1,),
            "model.pretrain_steps": 20,
        },
    )
    workdir = os.fspath(tmp_path)
    out = lora_da.run(config, workdir)
    assert out["rows"] == 7  # vanilla, pissa, lora_ga, lora_one, eva, lora_da β ∈ {0, .03}
    with open(os.path.join(workdir, "results.md")) as f:
        text = f.read()
    assert "lora_da_b0.03" in text and "configs/lora_da.py" in text
    assert os.path.exists(os.path.join(workdir, "init_loss.png"))
    cells = sweep.CellStore(workdir, log_metrics=False)
    cell = cells.get("r=1/lora_da_b0.03/seed=0", dict)
    assert set(cell) >= {"loss@10", "accuracy", "init_s"}
    # Rerunning reads every cell back and gives the same summary.
    assert lora_da.run(config, workdir) == out
