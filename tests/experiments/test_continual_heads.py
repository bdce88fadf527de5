"""config.head in the continual experiment: validation and a class-incremental head end to end."""

from __future__ import annotations

import numpy as np
import pytest

from configs import saber as saber_config
from experiments import common, continual
from lowrank_jax.continual.class_incremental import HeadState


def test_unknown_head_fails_with_the_allowed_values():
    config = saber_config.get_config("smoke")
    assert config.head == "aligned"  # shakespeare_plays: chosen on validation
    config.head = "cosine"
    with pytest.raises(common.ConfigError, match="'masked', 'aligned', 'prototype'"):
        continual.check_config(config)
    config.head = "aligned"
    config.method.heads.metric = "knn"
    with pytest.raises(common.ConfigError, match="method.heads.metric"):
        continual.check_config(config)


def test_gr_lora_with_aligned_head_runs_per_module(tmp_path):
    """GR-LoRA reads the task id (one module per task): the wrapper records each class under its
    task and compensates the drift per module; the run's accuracy matrix is complete."""
    config = saber_config.get_config("smoke,benchmark=digits_cil")
    config.data.num_tasks = 2
    config.schedule.steps_per_task = 8
    config.head = "aligned"
    config.method.heads.align_steps = 20
    config.log.progress = False
    continual.check_config(config)
    stream = continual.load_stream(config, 0)
    options = common.TrainOptions.from_config(config)
    workdir = str(tmp_path / "seed_0")
    model, variables = continual.build_backbone(config, stream, 0, workdir, options=options)
    out = continual.run_method(
        config, "gr_lora", 0, stream, model, variables, str(tmp_path), options=options
    )
    assert np.all(np.isfinite(out["R"][np.tril_indices(2)]))
    method = continual.make_method(config, "gr_lora", model.apply, "cil")
    assert isinstance(method.init(variables).extra, HeadState)
