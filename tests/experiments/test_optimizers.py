"""The config's optimizer (warm-up + cosine, AdamW/SGD, clipping, per-group peaks) and the
schedule/fit-option config checks."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from experiments.common import config_checks
from experiments.common.optimizers import warmup_cosine_optimizer


def _config(**optim):
    return ml_collections.ConfigDict(
        {
            "optim": {"name": "sgd", "learning_rate": 0.5, "weight_decay": 0.0, "grad_clip": 0.0}
            | optim,
            "schedule": {"num_steps": 10, "warmup_steps": 2},
            "ckpt": {"every": 5, "max_to_keep": 1},
            "log": {"every": 1},
        }
    )


def _updates(tx, params, grads, steps):
    state = tx.init(params)
    out = []
    for _ in range(steps):
        updates, state = tx.update(grads, state, params)
        out.append(updates)
    return out


def test_sgd_follows_warmup_then_cosine():
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.ones(3)}
    tx = warmup_cosine_optimizer(_config())
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.5, 2, 10, end_value=0.0)
    trace = 0.0
    for i, u in enumerate(_updates(tx, params, grads, 4)):
        trace = 0.9 * trace + 1.0  # momentum 0.9 on a constant gradient
        np.testing.assert_allclose(u["w"], -schedule(i) * trace * np.ones(3), rtol=1e-6)


def test_per_group_peaks_scale_each_group_and_clip_acts_first():
    params = {"params": {"w": jnp.ones(2)}, "adapters": {"a": jnp.ones(2)}}
    grads = jax.tree.map(lambda p: 4.0 * p, params)  # global norm 8
    grouped = warmup_cosine_optimizer(_config(), peaks={"params": 0.5, "adapters": 5.0})
    u = _updates(grouped, params, grads, 2)[-1]
    np.testing.assert_allclose(u["adapters"]["a"], 10.0 * u["params"]["w"], rtol=1e-6)
    single = _updates(warmup_cosine_optimizer(_config()), params, grads, 2)[-1]
    np.testing.assert_allclose(u["params"]["w"], single["params"]["w"], rtol=1e-6)
    clipped = _updates(warmup_cosine_optimizer(_config(grad_clip=1.0)), params, grads, 2)[-1]
    np.testing.assert_allclose(clipped["params"]["w"], single["params"]["w"] / 8.0, rtol=1e-6)
    with pytest.raises(ValueError, match="optim.name"):
        warmup_cosine_optimizer(_config(name="adam"))


def test_warmup_and_fit_option_checks():
    config = _config()
    assert config_checks.check_warmup(config) == (10, 2)
    config_checks.check_fit_options(config)
    config.schedule.warmup_steps = 10
    with pytest.raises(config_checks.ConfigError, match="warmup_steps=10 is invalid: must be < "):
        config_checks.check_warmup(config)
    config.ckpt.max_to_keep = 0
    with pytest.raises(config_checks.ConfigError, match="ckpt.max_to_keep"):
        config_checks.check_fit_options(config)
