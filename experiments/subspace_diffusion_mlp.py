"""The learned-score baseline of the P7 experiment (``experiments/subspace_diffusion.py``).

An MLP score trained by denoising score matching through ``experiments.common.fit``, sampled with
the exponential integrator of the kernel sampler (same ``t₀``, ``T`` and grid), with and without
the final Tweedie step. Its learning rate and parameterisation (the ε-network, or the
EDM-preconditioned denoiser) are tuned per ambient dimension ``D`` on a validation draw (``W₁`` to
fresh validation points, seed 0) with the same grid and number of steps at every ``D``; the choice
is then evaluated on the test draws of every seed. This is where independence of
``D`` is not automatic (the kernel sampler's Tweedie output is a convex combination of training
points, so it does not see ``D``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common
from lowrank_jax import generative as gen
from lowrank_jax.data import BatchIterator
from lowrank_jax.generative.baselines import ScoreMLP, dsm_loss, mlp_denoiser
from lowrank_jax.generative.kernel_score import (
    early_stopping_time,
    geometric_time_grid,
    reverse_diffusion,
    terminal_time,
)

__all__ = ["PARAMETERISATIONS", "dsm_setup", "mlp_sampler", "run_mlp_cell", "tuned_mlp_rows"]

PARAMETERISATIONS = ("eps", "edm")  # ε-network; EDM-preconditioned denoiser


def dsm_setup(config, n: int, k: int, dim: int, learning_rate: float, data_std: float | None):
    """``(state, step, apply, (t0, t_max))`` of a learned score on ``n`` points of dimension
    ``dim`` (intrinsic ``k``): the DSM ``fit`` step and the score MLP's forward (an ε-network, or
    with ``data_std`` the preconditioned denoiser of
    :func:`lowrank_jax.generative.baselines.dsm_loss`)."""
    t0 = early_stopping_time(n, k, scale=config.model.sigma_scale)
    t_max = terminal_time(n, scale=config.model.horizon_scale)
    model = ScoreMLP(tuple(config.model.mlp_features))
    apply = lambda p, xt, t: model.apply({"params": p}, xt, t)  # noqa: E731
    params = model.init(jax.random.key(config.seed), jnp.zeros((1, dim)), 1.0)["params"]
    tx = optax.adam(learning_rate)

    def step(state, frozen, batch, key):
        del frozen
        loss, grads = jax.value_and_grad(dsm_loss)(
            state["params"], apply, key, batch["x"], t_min=t0, t_max=t_max, data_std=data_std
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {**state, "params": optax.apply_updates(state["params"], updates)}
        return {**new, "opt_state": opt_state}, {"loss": loss}

    return {"params": params, "opt_state": tx.init(params), "step": 0}, step, apply, (t0, t_max)


def mlp_sampler(apply, times, data_std: float | None):
    """The jitted reverse diffusion of a learned score:
    ``sample(params, z) -> (Tweedie output, noisy sample at t₀)``."""

    @jax.jit
    def sample(params, z):
        denoise = mlp_denoiser(apply, params, data_std=data_std)
        noisy = reverse_diffusion(None, denoise, z, times, tweedie=False)
        return denoise(noisy, times[-1]), noisy

    return sample


def _data_std(x: np.ndarray, parameterisation: str) -> float | None:
    """``None`` for the ε-network; for ``"edm"`` the per-coordinate RMS of the training points
    (uncentred: the OU process shrinks towards 0)."""
    if parameterisation not in PARAMETERISATIONS:
        raise common.ConfigError(
            f"config.model.mlp_parameterisations: {parameterisation!r} not in {PARAMETERISATIONS}"
        )
    return None if parameterisation == "eps" else float(np.sqrt(np.mean(x**2)))


def run_mlp_cell(
    config, src, lr: float, param: str, seed: int, workdir: str, *, options: common.TrainOptions
) -> dict[str, Any]:
    """Trains the score on seed ``seed``'s training set with learning rate ``lr`` and
    parameterisation ``param`` (``common.fit`` with the run's ``options``); ``W₁`` of its samples
    to the validation and the seed's test draw."""
    n, k = config.model.mlp_n, src["k"]
    x = src["train"](n, seed).astype(np.float32)
    data_std = _data_std(x, param)
    state, step, apply, (t0, t_max) = dsm_setup(config, n, k, x.shape[1], lr, data_std)
    bs = min(config.schedule.batch_size, n)
    num_steps = config.schedule.mlp_steps
    result = common.fit(
        state,
        None,
        step,
        BatchIterator({"x": x}, batch_size=bs, seed=config.seed + seed),
        key=jax.random.key(config.seed + 1 + 100 * seed),
        num_steps=num_steps,
        workdir=workdir,
        log_every=min(config.log.every, num_steps),
        ckpt_every=num_steps,
        progress=False,
        options=options,
    )
    times = geometric_time_grid(t_max, t0, config.model.num_steps)
    z = jax.random.normal(jax.random.key(config.seed + 2 + 100 * seed), (src["m"], x.shape[1]))
    tweedie, noisy = (
        np.asarray(a) for a in mlp_sampler(apply, times, data_std)(result.state["params"], z)
    )
    true = src["true"](seed)
    return {
        "source": src["id"],
        "D": src["D"],
        "lr": lr,
        "parameterisation": param,
        "seed": seed,
        "w1_valid": gen.wasserstein1(tweedie, src["mlp_valid"]),
        "w1_mlp": gen.wasserstein1(tweedie, true),
        "w1_mlp_no_tweedie": gen.wasserstein1(noisy, true),
        "final_loss": float(result.history[-1].get("train/loss", math.nan)),
    }


def tuned_mlp_rows(
    config, sources, cached, fit_dir: str, *, options: common.TrainOptions
) -> list[dict[str, Any]]:
    """For every ``D`` of ``config.model.mlp_dims`` (at ``k = config.model.mlp_k``): the
    (learning rate, parameterisation) with the smallest validation ``W₁`` on seed 0, then that
    choice on every seed.

    ``cached(key, fn)`` reads a finished run back or computes and stores it (``CellStore.get``);
    each fit checkpoints under ``<fit_dir>/<key>``. Returns one row per
    ``(D, seed)`` with the choice and the validation ``W₁`` of every setting tried."""
    by_id = {s["id"]: s for s in sources}
    rows = []
    for dim in config.model.mlp_dims:
        src = by_id.get(f"syn-k{config.model.mlp_k}-D{dim}")
        if src is None:
            raise common.ConfigError(
                f"config.model.mlp_dims: no synthetic source k={config.model.mlp_k}, D={dim}"
            )

        def run(setting, seed, src=src):
            lr, param = setting
            cid = f"mlp-{src['id']}-n{config.model.mlp_n}-{param}-lr{lr:g}-s{seed}"
            return cached(
                cid,
                lambda: run_mlp_cell(
                    config, src, lr, param, seed, os.path.join(fit_dir, cid), options=options
                ),
            )

        grid = [
            (lr, p)
            for p in config.model.mlp_parameterisations
            for lr in config.model.mlp_learning_rates
        ]
        tried = {setting: run(setting, 0) for setting in grid}
        best = min(tried, key=lambda setting: tried[setting]["w1_valid"])
        valid = {f"{p} {lr:g}": round(r["w1_valid"], 4) for (lr, p), r in tried.items()}
        for seed in range(config.eval.num_seeds):
            r = tried[best] if seed == 0 else run(best, seed)
            rows.append({**r, "n": config.model.mlp_n, "valid_w1_by_lr": valid})
    return rows
