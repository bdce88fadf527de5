"""P7: W₁ sample complexity of the kernel-score diffusion sampler on unions of subspaces.

``run(config, workdir)`` evaluates, for every synthetic source ``(k, D)`` (three random subspaces
of dimensions ``(k, k, k-1)`` in ``R^D``), training size ``n`` and seed, the samplers of
``lowrank_jax.generative`` — kernel-score diffusion with and without its final Tweedie step (one
trajectory: the noisy sample at ``t₀`` and its denoised value), the empirical measure, and the
ambient Gaussian KDE with held-out-likelihood and Silverman bandwidths — by exact ``W₁`` to ``m``
fresh true samples of that seed, next to the seed's floor ``W₁(true, true')``. A learned
(DSM-MLP) score, tuned per ``D`` on a validation draw, tests independence of ``D`` where it is not
automatic (``experiments/subspace_diffusion_mlp.py``). Writes:

- ``cells/<id>.json`` (``common.sweep.CellStore``: one per source × n × seed, per seed's floor and
  per DSM-MLP fit; a rerun reads them back), ``mlp/<id>/`` (the DSM-MLP fits' checkpoints);
- ``results.md`` / ``results.json`` (``experiments/subspace_diffusion_report.py``): slopes of
  log W₁ and of log(W₁ - floor) vs log n (mean ± sd over seeds; also over the *resolved* cells
  only, ``W₁ ≥ eval.resolution × floor``), W₁ against D, trend checks;
- ``w1_vs_n.png`` (log-log, one panel per source) and ``samples.png``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments import subspace_diffusion_mlp as mlp
from experiments.common import sweep
from experiments.subspace_diffusion_report import (
    METHODS,
    checks,
    d_rows,
    notes,
    plots,
    summaries,
)
from lowrank_jax import generative as gen
from lowrank_jax.generative.baselines import silverman_bandwidth
from lowrank_jax.generative.kernel_score import (
    early_stopping_time,
    geometric_time_grid,
    kernel_denoiser,
)
from lowrank_jax.generative.subspaces import LAWS

__all__ = ["check_config", "run", "steps"]


def check_config(config) -> None:
    """Validates the config before anything is computed."""
    c = common
    d = config.data
    if not d.sources:
        raise c.ConfigError("config.data.sources needs at least one (k, D) pair")
    for k, dim in d.sources:
        if not 1 <= k <= dim:
            raise c.ConfigError(f"config.data.sources: k={k} exceeds D={dim} (or k < 1)")
    if len(d.weights) != 3 or len(d.laws) != 3:
        raise c.ConfigError("config.data.weights and config.data.laws need 3 entries (k, k, k-1)")
    for law in d.laws:
        if law not in LAWS:
            raise c.ConfigError(f"config.data.laws has {law!r}: allowed are {LAWS}")
    if len(d.sizes) < 2 or min(d.sizes) < 2:
        raise c.ConfigError("config.data.sizes needs >= 2 sizes >= 2 to fit a slope")
    methods = tuple(config.eval.methods)
    if not methods or set(methods) - set(METHODS) or "empirical" not in methods:
        raise c.ConfigError(
            f"config.eval.methods={methods!r}: a subset of {METHODS} holding 'empirical'"
        )
    if config.eval.resolution < 1:
        raise c.ConfigError(f"config.eval.resolution={config.eval.resolution} must be >= 1")
    mc = config.model
    missing = [dim for dim in mc.mlp_dims if (mc.mlp_k, dim) not in set(map(tuple, d.sources))]
    if missing:
        raise c.ConfigError(f"config.model.mlp_dims: (mlp_k, D) for D={missing} not in sources")
    if mc.mlp_dims and mc.mlp_n not in d.sizes:
        raise c.ConfigError(f"config.model.mlp_n={mc.mlp_n} must be one of data.sizes")
    if not mc.mlp_learning_rates or min(mc.mlp_learning_rates) <= 0:
        raise c.ConfigError("config.model.mlp_learning_rates: a non-empty grid of positive rates")
    bad = set(mc.mlp_parameterisations) - set(mlp.PARAMETERISATIONS)
    if not mc.mlp_parameterisations or bad:
        raise c.ConfigError(
            f"config.model.mlp_parameterisations: choose from {mlp.PARAMETERISATIONS}"
        )
    c.check_positive(config, "data.valid_size", integer=True)
    c.check_positive(config, "model.num_steps", integer=True)
    c.check_positive(config, "model.sigma_scale")
    c.check_positive(config, "model.horizon_scale")
    c.check_positive(config, "model.chunk_size", integer=True)
    c.check_nonnegative(config, "model.clip")
    c.check_positive(config, "model.kde_bandwidths", integer=True)
    c.check_positive(config, "model.mlp_n", integer=True)
    c.check_positive(config, "schedule.mlp_steps", integer=True)
    c.check_positive(config, "schedule.batch_size", integer=True)
    c.check_positive(config, "eval.num_samples", integer=True)
    c.check_positive(config, "eval.num_seeds", integer=True)


# --------------------------------------------------------------------------------------------
# A data source: a law to learn, its training draws, validation and fresh true samples per seed


def _synthetic(config, k: int, dim: int) -> dict[str, Any]:
    key = jax.random.fold_in(jax.random.key(config.seed), 1000 * k + dim)
    bases = gen.random_subspaces(key, dim, (k, k, k - 1))
    d, m = config.data, config.eval.num_samples

    def draw(tag: int, num: int) -> np.ndarray:
        x, _ = gen.sample_union_of_subspaces(
            jax.random.fold_in(key, tag), bases, num=num, weights=d.weights, laws=d.laws
        )
        return np.asarray(x, np.float64)

    return {
        "id": f"syn-k{k}-D{dim}",
        "k": k,
        "D": dim,
        "m": m,
        "bases": [np.asarray(b) for b in bases],
        "train": lambda n, seed: draw(10 + seed, n),
        "valid": draw(1, d.valid_size),  # KDE bandwidth
        "mlp_valid": draw(4, m),  # MLP learning rate
        "true": lambda seed: draw(100 + 2 * seed, m),
        "true2": lambda seed: draw(101 + 2 * seed, m),
    }


# --------------------------------------------------------------------------------------------
# One cell: every sampler at one (source, n, seed)


def _bandwidth_grid(x: np.ndarray, size: int) -> list[float]:
    radius = np.sqrt(float(np.mean(np.sum((x - x.mean(0)) ** 2, axis=1))))
    return [float(h) for h in radius * np.geomspace(1e-4, 1.0, size)]


def _kernel_sampler(config, k: int):
    """The kernel-score sampler of a cell, jitted: ``sample(key, x (n, D)) -> (Tweedie output,
    noisy sample at t₀)``, both ``(m, D)``, from one trajectory."""
    mc = config.model

    def sample(key, x):
        noisy = gen.sample_kernel_diffusion(
            key, x, num_samples=config.eval.num_samples, k=k, num_steps=mc.num_steps,
            stochastic=mc.stochastic, tweedie=False, sigma_scale=mc.sigma_scale,
            horizon_scale=mc.horizon_scale, chunk_size=mc.chunk_size, clip=mc.clip or None,
        )  # fmt: skip
        t0 = early_stopping_time(x.shape[0], k, scale=mc.sigma_scale)
        denoised = kernel_denoiser(
            noisy, x, jnp.asarray(t0, x.dtype), chunk_size=mc.chunk_size, clip=mc.clip or None
        )
        return denoised, noisy

    return jax.jit(sample)


def _run_cell(config, src, n: int, seed: int, sampler=None) -> dict[str, Any]:
    """``W₁`` of every sampler of ``config.eval.methods`` at one (source, n, seed); ``sampler``:
    the source's jitted :func:`_kernel_sampler` (built here when not given)."""
    t_start = time.time()
    x = src["train"](n, seed)
    m, methods = config.eval.num_samples, config.eval.methods
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), n), seed)
    keys = jax.random.split(key, 4)
    out = {"id": f"{src['id']}-n{n}-s{seed}", "source": src["id"], "n": n, "seed": seed}
    out.update(k=src["k"], D=src["D"])
    samples = {}
    if {"diffusion", "diffusion_no_tweedie"} & set(methods):
        t0 = time.time()
        sampler = sampler or _kernel_sampler(config, src["k"])
        tweedie, noisy = sampler(keys[0], jnp.asarray(x, jnp.float32))
        samples.update(diffusion=np.asarray(tweedie), diffusion_no_tweedie=np.asarray(noisy))
        out["sampler_s"] = time.time() - t0
    samples["empirical"] = np.asarray(gen.sample_empirical(keys[1], x, num_samples=m))
    if "kde_cv" in methods:
        grid = _bandwidth_grid(x, config.model.kde_bandwidths)
        out["h_cv"], _ = gen.select_kde_bandwidth(x, src["valid"], bandwidths=grid)
        samples["kde_cv"] = np.asarray(
            gen.sample_kde(keys[2], x, bandwidth=out["h_cv"], num_samples=m)
        )
    if "kde_silverman" in methods:
        out["h_silverman"] = silverman_bandwidth(x)
        samples["kde_silverman"] = np.asarray(
            gen.sample_kde(keys[3], x, bandwidth=out["h_silverman"], num_samples=m)
        )
    samples = {name: s for name, s in samples.items() if name in methods}
    true = src["true"](seed)
    for name, s in samples.items():
        out[f"w1_{name}"] = gen.wasserstein1(s, true)
    out["seconds"] = time.time() - t_start
    if seed == 0 and n == max(config.data.sizes):  # for the samples figure
        out["samples"] = {k: v[:300].tolist() for k, v in samples.items() if k != "kde_silverman"}
    return out


def steps(config, mesh=None) -> list[common.Step]:
    """On abstract inputs (no data): the kernel-score sampler at the largest ``n`` of each source,
    and each learned-score dimension's DSM ``fit`` step and sampler."""
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    spec, key = jax.ShapeDtypeStruct, jax.eval_shape(lambda: jax.random.key(0))
    out, n = [], max(config.data.sizes)
    for k, dim in config.data.sources:
        x = spec((n, dim), jnp.float32)
        out.append(common.Step(f"kernel sampler k={k} n={n} D={dim}", _kernel_sampler(config, k), (key, x)))  # fmt: skip
    n, k, lr = config.model.mlp_n, config.model.mlp_k, config.model.mlp_learning_rates[0]
    for dim in config.model.mlp_dims:
        state, (step, apply, (t0, t_max)) = common.eval_shape_with_static(
            lambda dim=dim: _split(mlp.dsm_setup(config, n, k, dim, lr, 1.0))
        )
        batch = {"x": spec((min(config.schedule.batch_size, n), dim), jnp.float32)}
        out.append(common.fit_step(step, state, None, batch, mesh=mesh, name=f"DSM D={dim}"))
        times = geometric_time_grid(t_max, t0, config.model.num_steps)
        z = spec((config.eval.num_samples, dim), jnp.float32)
        out.append(common.Step(f"MLP sampler D={dim}", mlp.mlp_sampler(apply, times, 1.0), (state["params"], z)))  # fmt: skip
    return out


def _split(setup):
    state, *static = setup
    return state, static


def run(config, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs every cell (``common.sweep.CellStore``: finished ones are read back), then writes the
    tables, checks and plots."""
    from tqdm import tqdm

    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    common.write_config_json(workdir, config)
    store = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume, log_metrics=False)
    sources = [_synthetic(config, k, d) for k, d in config.data.sources]
    seeds = range(config.eval.num_seeds)
    floors = {
        (s["id"], seed): store.get(
            f"floor-{s['id']}-s{seed}",
            lambda s=s, seed=seed: {"floor": gen.wasserstein1(s["true"](seed), s["true2"](seed))},
        )["floor"]
        for s in sources
        for seed in seeds
    }
    cells, samplers = [], {k: _kernel_sampler(config, k) for k in {s["k"] for s in sources}}
    todo = [(s, n, seed) for s in sources for n in config.data.sizes for seed in seeds]
    for src, n, seed in tqdm(todo, desc="cells"):
        key = f"{src['id']}-n{n}-s{seed}"
        cells.append(
            store.get(key, lambda s=src, n=n, e=seed: _run_cell(config, s, n, e, samplers[s["k"]]))
        )
    mlp_rows = []
    if config.model.mlp_dims:
        mlp_rows = mlp.tuned_mlp_rows(
            config, sources, store.get, os.path.join(workdir, "mlp"), options=options
        )
    store.close()
    rows = summaries(config, sources, cells, floors)
    by_d = d_rows(config, sources, cells, floors, mlp_rows)
    trend = checks(config, rows, by_d)
    pngs = plots(workdir, sources, cells, floors)
    common.write_results_md(
        workdir,
        rows,
        title="P7: W₁ vs n of the kernel-score diffusion sampler",
        notes=notes(config, trend, by_d, mlp_rows),
        columns=["source", "k", "D", "method", "slope", "slope_sd", "slope_excess",
                 "slope_excess_sd", "excess_points", "slope_resolved", "slope_resolved_sd",
                 "resolved_points", "target", "w1_n_min", "w1_n_max", "floor", "w1_over_floor",
                 "ratio_to_empirical"],
    )  # fmt: skip
    result = {
        "rows": rows,
        "checks": trend,
        "by_dimension": by_d,
        "mlp": mlp_rows,
        "plots": pngs,
        "cells": len(cells),
    }
    common.write_json(os.path.join(workdir, "results.json"), result)
    return result
