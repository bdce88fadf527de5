"""P3: LoRA forgetting as drift of mean-field attention token dynamics (specs §3 (4)).

Synthetic grid: per cell ``(model, d, gap, seed)`` one jitted
:func:`lowrank_jax.analysis.perturbed_drift` call integrates the unperturbed flow and, under
``vmap``, every perturbation (directions × ε); the cell keeps ``D(T)``, ``max_t D``, ``T_dev``
and ``W₂`` at ``T`` per perturbation, and (seed 0) the drift curves for heat maps. Real
weights: the same on each MiniLM head's ``Q_h, K_h, V_h`` from the layer's real inputs.

The method (flow, RK4, drift, ``T_dev``, ``W₂``, fits) lives in
``lowrank_jax.analysis.attention_dynamics``; this module wires cells and writes ``results.md``,
``summary.json`` and plots. Finished cells live in ``<workdir>/cells`` (resumable).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from experiments import common
from experiments.common import sweep
from lowrank_jax import analysis as an
from lowrank_jax import data, models

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
    w2 = [an.wasserstein2(x, ref_t) for x in np.asarray(x_t)]
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
        unit = an.random_lowrank_perturbation(k, d, rank=r, eps=1.0)
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
    layers = models.bert_attention_inputs(cfg, variables, **batch)
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
    q, k, v = an.head_matrices(*kernels, num_heads=x0.shape[-1] // width, head=head)
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


# ----------------------------------------------------------------------------------------------
# Tables, checks and plots.


def _nanmean(values):
    v = np.asarray(values, np.float64)
    return float(np.nanmean(v)) if np.any(np.isfinite(v)) else float("nan")


def _nanmedian(values):
    v = np.asarray(values, np.float64)
    return float(np.nanmedian(v)) if np.any(np.isfinite(v)) else float("nan")


def _synthetic_rows(config, cells):
    """One row per (model, d, gap, direction); fits per seed, averaged over seeds."""
    rows, dd = [], config.data
    for model, d, g in ((m, d, g) for m in dd.models for d in dd.dims for g in dd.gaps):
        cs = [cells[(model, d, g, s)] for s in range(dd.num_seeds)]
        eps = np.asarray(cs[0]["eps"])
        for i, name in enumerate(DIRECTIONS):
            sl = slice(i * len(eps), (i + 1) * len(eps))
            fits = [an.drift_time_fit(eps, np.asarray(c["t_dev"][sl])) for c in cs]
            d_final = np.mean([c["d_final"][sl] for c in cs], axis=0)
            below = np.flatnonzero(eps <= g / 2 * (1 + 1e-6))
            rows.append(
                {
                    "model": model,
                    "d": d,
                    "gap": g,
                    "direction": name,
                    **{k: _nanmean([f[k] for f in fits]) for k in ("r2", "slope", "power_r2")},
                    "finite T_dev": int(np.isfinite(cs[0]["t_dev"][sl]).sum()),
                    "D(T) eps<=g/2": d_final[below[-1]] if len(below) else "",
                    "D(T) eps>=2g": d_final[np.flatnonzero(eps >= 2 * g * (1 - 1e-6))[0]],
                    "jump": an.drift_jump_ratio(d_final, eps, below=g / 2, above=2 * g),
                    "W2(T) eps=max": _nanmean([c["w2_final"][sl][-1] for c in cs]),
                }
            )
    return rows


def _synthetic_checks(config, rows, cells):
    dd, checks = config.data, []
    by = {(r["model"], r["d"], r["gap"], r["direction"]): r for r in rows}
    for model in dd.models:
        r2 = [r["r2"] for r in rows if r["model"] == model]
        good = int(sum(bool(np.isfinite(v) and v > 0.9) for v in r2))
        pw = _nanmedian([r["power_r2"] for r in rows if r["model"] == model])
        checks.append(
            sweep.check(
                f"(a) {model}: T_dev affine in log(1/eps), R2 > 0.9 (mean over seeds)",
                good == len(r2),
                f"{good}/{len(r2)} (d, gap, direction); median R2 {_nanmedian(r2):.3f} "
                f"(power law in eps: {pw:.3f})",
            )
        )
    jumps, plateaus = [], []
    for d, g in ((d, g) for d in dd.dims for g in dd.gaps):
        cr, al = by[("sphere", d, g, "crossing")], by[("sphere", d, g, "aligned")]
        jumps.append((d, g, cr["jump"], al["jump"], cr["D(T) eps>=2g"]))
        c, eps = cells[("sphere", d, g, 0)], np.asarray(cells[("sphere", d, g, 0)]["eps"])
        j = np.flatnonzero(eps <= g / 2 * (1 + 1e-6))
        if len(j):
            i = DIRECTIONS.index("crossing") * len(eps) + j[-1]
            plateaus.append((d, g, c["d_final"][i] / max(c["d_max"][i], 1e-12), c["t_half"][i]))
    ok = [bool(c >= 5 * a and top >= 0.5) for _, _, c, a, top in jumps]
    checks.append(
        sweep.check(
            "(b) sphere: D(T) jumps at eps ~ gap for gap-crossing (>= 5x aligned's ratio, D >= 0.5)",
            sum(ok) == len(ok),
            f"{sum(ok)}/{len(ok)}: "
            + "; ".join(
                f"d={d},g={g}: crossing {c:.1f}x vs aligned {a:.1f}x" for d, g, c, a, _ in jumps
            ),
        )
    )
    checks.append(
        sweep.check(
            "(c) sphere, gap-crossing eps <= g/2: D grows then plateaus (D(T) >= 0.5 max_t D)",
            bool(plateaus) and all(bool(r >= 0.5) for _, _, r, _ in plateaus),
            "; ".join(
                f"d={d},g={g}: D(T)/max D {r:.2f}, half-rise t={t:.1f}" for d, g, r, t in plateaus
            ),
        )
    )
    return checks


def _minilm_rows_checks(config, mcells):
    rows, n = [], len(config.minilm.ratios)
    for (layer, head), c in mcells.items():
        eps, ratios = np.asarray(c["eps"]), np.asarray(c["ratios"])
        row = {
            "model": f"MiniLM L{layer}H{head}",
            "gap": c["gap"],
            "beta": c["beta"],
            "norm V": c["v_norm"],
        }
        for i, name in enumerate(("aligned", "crossing")):
            sl = slice(i * n, (i + 1) * n)
            row[f"{name} jump"] = an.drift_jump_ratio(
                c["d_final"][sl], ratios, below=0.5, above=2.0
            )
            row[f"{name} R2"] = an.drift_time_fit(eps, np.asarray(c["t_dev"][sl]))["r2"]
        rows.append(row)
    sharp = sum(r["crossing jump"] >= 5 * r["aligned jump"] for r in rows)
    r2s = [r[f"{k} R2"] for r in rows for k in ("aligned", "crossing")]
    med = {k: np.median([r[f"{k} jump"] for r in rows]) for k in ("aligned", "crossing")}
    checks = [
        sweep.check(
            "(b) MiniLM heads: D(T) jumps at eps ~ gap for crossing (>= 5x aligned's ratio)",
            bool(sharp > len(rows) / 2),
            f"{sharp}/{len(rows)} heads; median D(2g)/D(g/2) crossing {med['crossing']:.2f} vs "
            f"aligned {med['aligned']:.2f}",
        ),
        sweep.check(
            "(a) MiniLM heads: T_dev affine in log(1/eps), R2 > 0.9",
            bool(np.all(np.asarray(r2s) > 0.9)),
            f"{int(np.sum(np.asarray(r2s) > 0.9))}/{len(r2s)} (head, direction) fits; median R2 "
            f"{_nanmedian(r2s):.3f}",
        ),
    ]
    return rows, checks


def _heatmap(path, c, eps, g, title):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    curves = np.asarray(c["curves"])
    t = np.arange(curves.shape[1]) * 5 * c["dt_record"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for i, (ax, name) in enumerate(zip(axes, ("aligned", "crossing"), strict=True)):
        im = ax.pcolormesh(t, eps, curves[i * len(eps) : (i + 1) * len(eps)], shading="nearest")
        ax.set_yscale("log")
        ax.axhline(g, color="w", ls=":")
        ax.set(title=f"D(t, eps), {name}", xlabel="depth t", ylabel="eps")
        fig.colorbar(im, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plots(workdir, config, cells, mcells):
    dd = config.data
    for model, d, g in ((m, d, g) for m in dd.models for d in dd.dims for g in dd.gaps):
        c, tag = cells[(model, d, g, 0)], f"{model}_d{d}_g{g}"
        eps = np.asarray(c["eps"])
        _heatmap(os.path.join(workdir, f"heatmap_{tag}.png"), c, eps, g, f"{model}, d={d}, gap={g}")
        per = {n: slice(i * len(eps), (i + 1) * len(eps)) for i, n in enumerate(DIRECTIONS)}
        tdev = {n: np.asarray(c["t_dev"][sl]) for n, sl in per.items()}
        common.plot_curves(
            os.path.join(workdir, f"tdev_{tag}.png"),
            {n: (np.log(1 / eps)[np.isfinite(t)], t[np.isfinite(t)]) for n, t in tdev.items()},
            title=f"T_dev(eps, delta={config.eval.delta}), {model}, d={d}, gap={g}",
            xlabel="log(1/eps)",
            ylabel="T_dev",
        )
        common.plot_curves(
            os.path.join(workdir, f"dfinal_{tag}.png"),
            {n: (np.log10(eps), c["d_final"][sl]) for n, sl in per.items()},
            title=f"D(T, eps), {model}, d={d}, gap={g}",
            xlabel="log10 eps",
            ylabel="D(T)",
            marks={"gap": float(np.log10(g))} if g > 0 else None,
        )
    if mcells:
        n, x = len(config.minilm.ratios), np.log10(config.minilm.ratios)
        dfin = np.asarray([c["d_final"] for c in mcells.values()])
        common.plot_curves(
            os.path.join(workdir, "minilm_dfinal.png"),
            {
                k: (x, np.median(dfin[:, i * n : (i + 1) * n], 0))
                for i, k in enumerate(("aligned", "crossing"))
            },
            title="MiniLM heads: median D(T) vs eps / gap",
            xlabel="log10(eps / gap)",
            ylabel="D(T)",
            marks={"gap": 0.0},
        )
        for (layer, head), c in list(mcells.items())[:2]:
            _heatmap(
                os.path.join(workdir, f"heatmap_minilm_L{layer}H{head}.png"),
                c,
                np.asarray(c["ratios"]),
                1.0,
                f"MiniLM layer {layer} head {head} (eps in units of the gap)",
            )


def run(config: Any, workdir: str) -> dict:
    """Runs the synthetic grid and the MiniLM heads; writes results.md, summary.json, plots."""
    check_config(config)
    common.write_config_json(workdir, config)
    store = sweep.CellStore(workdir, resume=config.ckpt.resume)
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
    rows = _synthetic_rows(config, cells)
    checks = _synthetic_checks(config, rows, cells)
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
        mrows, mchecks = _minilm_rows_checks(config, mcells)
        checks += mchecks
    store.close()
    _plots(workdir, config, cells, mcells)
    columns = ["model", "d", "gap", "direction", "r2", "slope", "power_r2", "finite T_dev"]
    columns += ["D(T) eps<=g/2", "D(T) eps>=2g", "jump", "W2(T) eps=max"]
    out = sweep.write_sweep_results(
        workdir,
        rows,
        checks,
        title="P3 mean-field attention: drift under rank-1 / low-rank perturbations",
        columns=columns,
        command=sweep.command_line(
            "python -m experiments.train --config=configs/attention_dynamics.py"
        ),
        extra={"minilm_heads": len(mrows)} if mrows else None,
    )
    if mrows:  # a second table: per MiniLM head, jump ratios and T_dev fits (eps in gap units)
        mcols = ["model", "gap", "beta", "norm V", "aligned jump", "aligned R2", "crossing jump"]
        common.write_json(os.path.join(workdir, "minilm.json"), mrows)
        with open(os.path.join(workdir, "results.md"), "a") as f:
            f.write(
                "\n\n## MiniLM heads (jump = D(T, 2 gap) / D(T, gap / 2); R2 of T_dev vs "
                "log 1/eps)\n\n"
                + sweep.markdown_table(
                    rows=mrows, columns=[(c, c) for c in [*mcols, "crossing R2"]]
                )
                + "\n"
            )
    return out
