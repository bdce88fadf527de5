"""The continual-learning experiment: config checks, method invariants and a smoke run end to end."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gr_lora as gr_config
from configs import saber as saber_config
from experiments import common, continual
from lowrank_jax import optim


def _tiny(arg: str):
    config = saber_config.get_config(arg)
    config.data.num_tasks = 2
    config.schedule.steps_per_task = 8
    config.model.pretrain_steps = 10
    config.log.progress = False
    return config


def test_config_args_fail_early_with_allowed_values():
    with pytest.raises(common.ConfigError, match="allowed values are .*split_digits"):
        saber_config.get_config("benchmark=cifar")
    with pytest.raises(common.ConfigError, match="allowed values are all, every, saber"):
        saber_config.get_config("method=ewc")
    config = saber_config.get_config("smoke")
    config.methods = ("saber", "nope")
    with pytest.raises(common.ConfigError, match="nope"):
        continual.check_config(config)
    assert saber_config.get_config("method=o_lora").methods == ("o_lora",)
    assert len(saber_config.get_config("method=every").methods) == 8
    assert gr_config.get_config("seeds=3").seeds == (0, 1, 2)
    for arg in ("smoke", "smoke,benchmark=long_stream", "smoke,benchmark=digits_cil"):
        continual.check_config(saber_config.get_config(arg))
        continual.check_config(gr_config.get_config(arg))


def test_projection_methods_do_not_change_old_task_outputs():
    """InfLoRA/GPM-LoRA keep A ⟂ memory, so a memory-spanned old input sees no change."""
    config = _tiny("smoke,benchmark=digits_cil")
    stream = continual.load_stream(config, 0)
    model, variables = continual.build_backbone(config, stream, 0, "/tmp/unused")
    learner = continual.Learner(config, "gpm_lora", model, variables, stream)
    x_old = stream.tasks[0]["train"]["x"][:64]
    # memory = everything task 0's layer-1 inputs span (threshold 1)
    inputs = learner._layer_inputs(x_old)
    k = "params/dense_0/kernel"
    learner.memory[k] = optim.extend_subspace_memory(learner.memory[k], inputs[k], threshold=1.0)
    task = learner.setup(1, jax.random.key(0))
    a = task.trainable["shared"][k].factors["a"]
    basis = learner.memory[k].basis
    np.testing.assert_allclose(x_old @ (a - basis @ (basis.T @ a)), x_old @ a, atol=1e-5)
    np.testing.assert_allclose(jnp.asarray(x_old) @ a, 0.0, atol=1e-4)


def test_smoke_run_end_to_end_and_resume(tmp_path):
    config = _tiny("smoke")
    config.methods = ("saber", "gr_lora", "joint")
    workdir = str(tmp_path / "run")
    out = continual.run(config, workdir)
    assert not out["interrupted"]
    table = out["table"]
    assert set(table) == set(config.methods)
    for method in ("saber", "gr_lora"):
        assert 0.0 <= table[method]["final_acc"] <= 1.0
        assert np.isfinite(table[method]["forgetting"])
    for name in ("results.md", "accuracy_matrices.json", "acc_matrix_saber.png", "plasticity.png"):
        assert os.path.exists(os.path.join(workdir, name)), name
    with open(os.path.join(workdir, "accuracy_matrices.json")) as f:
        matrices = json.load(f)
    r = np.asarray(matrices["saber"][0]["R"], float)
    assert r.shape == (2, 2) and np.isnan(r[0, 1]) and np.all(np.isfinite(np.tril(r)))
    assert os.path.exists(os.path.join(workdir, "saber", "seed_0", "task_1", "checkpoints"))
    # rerunning resumes from the per-task checkpoints and reproduces the table exactly
    again = continual.run(config, workdir)
    assert again["table"]["saber"]["final_acc"] == table["saber"]["final_acc"]
    assert again["table"]["gr_lora"]["final_acc"] == table["gr_lora"]["final_acc"]
