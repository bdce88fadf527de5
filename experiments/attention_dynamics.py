"""P3: LoRA forgetting as drift of mean-field attention token dynamics (specs §3 (4)).

Synthetic grid: per cell ``(model, d, gap, seed)`` one jitted
:func:`lowrank_jax.analysis.perturbed_drift` call integrates the unperturbed flow and, under
``vmap``, every perturbation (directions × ε); the cell keeps ``D(T)``, ``max_t D``, ``T_dev``
and ``W₂`` at ``T`` per perturbation, and (seed 0) the drift curves for heat maps. Real
weights: the same on each MiniLM head's ``Q_h, K_h, V_h`` from the layer's real inputs.

The method (flow, RK4, drift, ``T_dev``, ``W₂``, fits) lives in
``lowrank_jax.analysis.attention_dynamics``; this module wires cells, and
:mod:`experiments.common.attention_dynamics_report` writes ``results.md``, ``summary.json`` and
plots. Finished cells live in ``<workdir>/cells`` (resumable).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from experiments import common
from experiments.common import attention_dynamics_report as report
from experiments.common import sweep
from lowrank_jax import analysis as an
from lowrank_jax import data, models
from lowrank_jax.analysis.attention_dynamics import (
    head_matrices,
    random_lowrank_perturbation,
    wasserstein2,
)
from lowrank_jax.models import bert

V_DIRECTIONS = ("aligned", "crossing", "random_lowrank", "random_fullrank")
DIRECTIONS = (*V_DIRECTIONS, "k_lowrank")  # the last perturbs K instead of V


def check_config(config: Any) -> None:
    """Validates ``config`` (raises ``common.ConfigError``)."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    for key in ("data.num_tokens", "data.num_eps", "data.num_seeds", "model.record_every"):
        c.check_positive(config, key, integer=True)
    for key in ("model.dt", "model.t_max", "model.t_max_unnormalised", "eval.delta"):
        c.check_positive(config, key)
    c.check_nonnegative(config, "model.beta")
    lo, hi = config.data.eps_range
    if not 0 < lo < hi:
        raise c.ConfigError(f"config.data.eps_range={config.data.eps_range}: need 0 < lo < hi")
    for m in config.data.models:
        if m not in ("sphere", "unnormalised"):
            raise c.ConfigError(f"config.data.models holds {m!r}: use 'sphere' or 'unnormalised'")
    for g in config.data.gaps:
        if not 0 <= g < 1:
            raise c.ConfigError(f"config.data.gaps holds {g}: need 0 <= gap < 1")
    if min(config.data.dims) < 2 or config.data.random_rank < 1:
        raise c.ConfigError("config.data.dims must be >= 2 and data.random_rank >= 1")
    if any(r <= 0 for r in config.minilm.ratios):
        raise c.ConfigError("config.minilm.ratios must be > 0 (multiples of each head's gap)")


def _steps(config: Any, t_max: float) -> int:
    every = config.model.record_every
    return max(every, int(round(t_max / config.model.dt / every)) * every)


@functools.partial(jax.jit, static_argnames=("which", "kw"))
def _drift(x0, q, k, v, deltas, beta, which, kw):
    """Drift curves and final tokens (one compilation per shape, ``which`` and settings)."""
    return an.perturbed_drift(
        x0, q, k, v, deltas, which=which, beta=beta, return_final=True, **dict(kw)
    )


def _summaries(config, drift, ref_t, x_t, dt_rec):
    """Per-perturbation D(T), max D, T_dev, W2(T) (host floats)."""
    drift = np.asarray(drift, np.float64)
    t_dev = np.asarray(an.time_to_deviation(drift, dt_record=dt_rec, delta=config.eval.delta))
    w2 = [wasserstein2(x, ref_t) for x in np.asarray(x_t)]
    return {
        "d_final": drift[:, -1].tolist(),
        "d_max": drift.max(1).tolist(),
        "t_dev": t_dev.tolist(),
        "w2_final": w2,
        "t_half": [float(np.argmax(c >= 0.5 * c.max()) * dt_rec) for c in drift],
    }


def _settings(config: Any, t_max: float, sphere: bool) -> tuple[tuple[str, Any], ...]:
    """``_drift``'s static ``kw``: step size, step count, recording interval, sphere or R^d."""
    m = config.model
    steps = _steps(config, t_max)
    return (
        ("dt", m.dt),
        ("num_steps", steps),
        ("record_every", m.record_every),
        ("sphere", sphere),
    )


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The jitted token dynamics (``_drift``) of every synthetic model at the largest dimension,
    for value and key perturbations, on abstract inputs (the MiniLM heads run the same program on
    their own sizes)."""
    del mesh  # one device
    check_config(config)
    dd, m, spec = config.data, config.model, jax.ShapeDtypeStruct
    d, out = max(dd.dims), []
    mat = spec((d, d), jnp.float32)
    beta = spec((), jnp.float32, weak_type=True)
    for model in dd.models:
        t_max = m.t_max if model == "sphere" else m.t_max_unnormalised
        kw = _settings(config, t_max, model == "sphere")
        for which, count in (("v", 4 * dd.num_eps), ("k", dd.num_eps)):
            args = (spec((dd.num_tokens, d), jnp.float32), mat, mat, mat, spec((count, d, d), jnp.float32), beta)  # fmt: skip
            out.append(common.Step(f"{model} d={d} {which}", _drift, args, {"which": which, "kw": kw}))  # fmt: skip
    return out


def synthetic_cell(config: Any, model: str, d: int, gap: float, seed: int) -> dict:
    dd, m = config.data, config.model
    key = jax.random.fold_in(jax.random.key(config.seed), seed)
    kx, kr, kf, kk = jax.random.split(key, 4)
    eps = jnp.logspace(*np.log10(dd.eps_range), dd.num_eps)
    x0 = an.sample_sphere(kx, dd.num_tokens, d)
    v, eye = an.gap_value_matrix(d, gap=gap), jnp.eye(d)
    sp = an.value_spectrum(v)
    rank = min(dd.random_rank, d)

    def rank_one(u):
        return jax.vmap(lambda e: an.rank_one_perturbation(u, eps=e))(eps)

    def random(k, r):  # one random direction per cell, scaled over the ε grid
        unit = random_lowrank_perturbation(k, d, rank=r, eps=1.0)
        return eps[:, None, None] * unit

    dv = jnp.concatenate([rank_one(sp.top), rank_one(sp.second), random(kr, rank), random(kf, d)])
    dk = random(kk, rank)
    t_max = m.t_max if model == "sphere" else m.t_max_unnormalised
    kw = _settings(config, t_max, model == "sphere")
    drift_v, ref_t, xv = _drift(x0, eye, eye, v, dv, m.beta, "v", kw)
    drift_k, _, xk = _drift(x0, eye, eye, v, dk, m.beta, "k", kw)
    drift = jnp.concatenate([drift_v, drift_k])
    dt_rec = m.dt * m.record_every
    out = _summaries(config, drift, ref_t, jnp.concatenate([xv, xk]), dt_rec)
    out.update(eps=np.asarray(eps).tolist(), directions=list(DIRECTIONS), dt_record=dt_rec)
    if seed == 0:  # curves for heat maps and depth plots (every 5th record)
        out["curves"] = np.round(np.asarray(drift[:, ::5], np.float64), 5).tolist()
    return out


def minilm_inputs(config: Any) -> tuple[list, np.ndarray]:
    """Per layer ``(x (P, n, d) normalised tokens, β, attention params)`` of real passages."""
    mc = config.minilm
    cfg, variables, tokenizer = models.load_minilm()
    ds = data.load_shakespeare(
        passage_chars=mc.passage_chars, plays=mc.plays, max_passages_per_play=1, seed=config.seed
    )
    batch = models.tokenize(tokenizer, list(ds.x), max_len=mc.num_tokens)
    if not np.all(batch["attention_mask"]):
        raise common.ConfigError(
            f"a passage has fewer than minilm.num_tokens={mc.num_tokens} word pieces: raise "
            "minilm.passage_chars or lower num_tokens"
        )
    layers = bert.attention_inputs(cfg, variables, **batch)
    heads = cfg.num_attention_heads
    width = cfg.hidden_size // heads
    out = []
    for layer in mc.layers:
        x, _, att = layers[layer]
        x = np.asarray(x, np.float64)
        r = np.linalg.norm(x, axis=-1, keepdims=True)
        beta = float(np.mean(r**2) / np.sqrt(width))
        out.append(((x / r).astype(np.float32), beta, att, width))
    return out, ds.x


def minilm_cell(config: Any, x0, beta, att, width, head) -> dict:
    mc, m = config.minilm, config.model
    kernels = [att[n]["kernel"] for n in ("query", "key", "value", "out")]
    q, k, v = head_matrices(*kernels, num_heads=x0.shape[-1] // width, head=head)
    sp = an.value_spectrum(v)
    ratios = jnp.asarray(mc.ratios, jnp.float32)
    eps = sp.gap * ratios
    dv = jnp.concatenate(
        [
            jax.vmap(lambda e, u=u: an.rank_one_perturbation(u, eps=e))(eps)
            for u in (sp.top, sp.second)
        ]
    )
    kw = _settings(config, mc.t_max, True)
    qk = (q, k, v)
    dt_rec = m.dt * m.record_every
    per, curves = [], []
    for p in range(x0.shape[0]):
        drift, ref_t, xt = _drift(jnp.asarray(x0[p]), *qk, dv, beta, "v", kw)
        per.append(_summaries(config, drift, ref_t, xt, dt_rec))
        curves.append(np.asarray(drift[:, ::5], np.float64))
    mean = {key: np.mean([r[key] for r in per], axis=0).tolist() for key in per[0]}
    return {
        **mean,
        "curves": np.round(np.mean(curves, axis=0), 5).tolist(),
        "dt_record": dt_rec,
        "gap": float(sp.gap),
        "lambda": np.asarray(sp.eigenvalues[:3], np.float64).tolist(),
        "v_norm": float(np.linalg.norm(np.asarray(v, np.float64), 2)),
        "beta": beta,
        "eps": np.asarray(eps, np.float64).tolist(),
        "ratios": list(mc.ratios),
    }


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict:
    """Runs the synthetic grid and the MiniLM heads; writes results.md, summary.json, plots."""
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    common.write_config_json(workdir, config)
    store = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume)
    dd = config.data
    grid = [
        (model, d, g, s)
        for model in dd.models
        for d in dd.dims
        for g in dd.gaps
        for s in range(dd.num_seeds)
    ]
    cells = {}
    for cell in tqdm.tqdm(grid, disable=not config.log.progress, desc="synthetic"):
        name = "synthetic/{}/d={}/gap={}/seed={}".format(*cell)
        cells[cell] = store.get(name, lambda cell=cell: synthetic_cell(config, *cell))
    rows = report.synthetic_rows(config, cells, DIRECTIONS)
    checks = report.synthetic_checks(config, rows, cells, DIRECTIONS)
    mcells, mrows = {}, []
    if config.minilm.enabled:
        mc = config.minilm
        names = {(la, h): f"minilm/layer={la}/head={h}" for la in mc.layers for h in mc.heads}
        inputs = None
        for (layer, head), name in tqdm.tqdm(
            names.items(), disable=not config.log.progress, desc="minilm"
        ):
            if name not in store and inputs is None:
                inputs, _ = minilm_inputs(config)
            args = None if inputs is None else inputs[mc.layers.index(layer)]
            mcells[(layer, head)] = store.get(
                name, lambda a=args, h=head: minilm_cell(config, *a[:3], a[3], h)
            )
        mrows, mchecks = report.minilm_rows_checks(config, mcells)
        checks += mchecks
    store.close()
    report.plots(workdir, config, cells, mcells, DIRECTIONS)
    return report.write_results(workdir, rows, checks, mrows)
