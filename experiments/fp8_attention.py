"""FP8 attention logits under transients: geometry-aware scales against delayed scaling (P14).

A small pre-LN causal transformer (``models.Fp8Transformer``) is trained from scratch on a copy
task with its attention logits cast to FP8 E4M3 at per-(layer, head) scales from an
``fp8.ScalingPolicy``: ``delayed:<h>`` (Transformer Engine, ``amax`` history ``h``), ``current``
(the just-in-time oracle), ``rank_aware:<γ|auto>`` (P14's scale from ``σ_max(W^Q_h W^{K⊤}_h)``,
one warm-started power step per step), ``rank_agnostic``, ``none`` (float32); a geometry policy
with the suffix ``+online`` multiplies its bound by an online calibration factor ``κ`` learned
from the observed ``max|S|/bound`` (``fp8.online_calibration`` of the geometry policy; the
metric ``online_kappa``). Three transients
are injected inside the jitted step as functions of the step: ``W^Q ← 4 W^Q``, a learning-rate
spike, and loading a donor run's parameters (then ``policy.reset``). Per policy and step:
overflows (saturated logits), utilisation ``max|S|·s/R``, softmax error vs float32, loss, and
``max|S|`` over the rank-aware bound. The pretrained
MiniLM's scales against its max logit on real text are ``experiments/fp8_minilm.py``.

Each run (the donor, one per policy) trains through ``common.fit`` in ``<workdir>/donor`` and
``<workdir>/policies/<policy>``, so rerunning resumes. Writes ``config.json``, ``metrics.jsonl``
(keys ``<policy>/<metric>``), TensorBoard events, five PNG timelines, ``results.md`` and
``results.json``.

References: P14, arXiv 2602.18851 (reconstruction, see ``lowrank_jax.fp8``); specs.md §14 (4).
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import common
from experiments.common.fp8_attention_report import (
    TRACKING,
    notes,
    plot_timelines,
    summarise,
    tightness_rows,
)
from lowrank_jax import fp8, models
from lowrank_jax.fp8.online import OnlineCalibrationState
from lowrank_jax.fp8.policies import GeometryScalingState, current_scaling_policy
from lowrank_jax.models.fp8_transformer import fp8_attention_geometry

POLICY_KINDS = ("delayed", "current", "rank_aware", "rank_agnostic", "none")
METRICS = ("loss", "overflow", "utilisation", "softmax_error", "amax", "bound_ratio", "scale")
METRICS += ("online_kappa",)  # +online policies: max over heads of the calibration factor κ


class Policy(NamedTuple):
    """A parsed policy name (``delayed:16``, ``current``, ``rank_aware:2``, ...)."""

    name: str
    kind: str
    history_len: int = 0
    gamma: float | None = None
    online: bool = False


def parse_policy(name: str) -> Policy:
    """``"delayed:<h>" | "current" | "rank_aware:<γ|auto>" | "rank_agnostic" | "none"``; a
    geometry policy with the suffix ``+online`` learns its calibration online
    (``fp8.online_calibration`` of ``fp8.geometry_scaling_policy``)."""
    base, online = name.removesuffix("+online"), name.endswith("+online")
    if online and not base.startswith("rank_"):
        base = "invalid"
    kind, _, arg = base.partition(":")
    try:
        if online and kind == "rank_aware" and (arg in ("", "auto") or float(arg) > 0):
            gamma = None if arg in ("", "auto") else float(arg)
            return Policy(name, kind, gamma=gamma, online=True)
        if online and kind == "rank_agnostic" and not arg:
            return Policy(name, kind, online=True)
        if kind == "delayed" and int(arg) >= 1:
            return Policy(name, kind, history_len=int(arg))
        if kind == "rank_aware" and (arg in ("", "auto") or float(arg) > 0):
            return Policy(name, kind, gamma=None if arg in ("", "auto") else float(arg))
        if kind in POLICY_KINDS and kind not in ("delayed", "rank_aware") and not arg:
            return Policy(name, kind)
    except ValueError:
        pass
    raise common.ConfigError(
        f"policy {name!r} is invalid: write delayed:<history length> (e.g. delayed:16), current, "
        "rank_aware:<gamma> or rank_aware:auto, rank_agnostic (either with +online), or none"
    )


def make_policy(p: Policy, config) -> fp8.ScalingPolicy:
    """The library policy for a parsed name (``none`` scales like ``current``, unquantised)."""
    if p.kind == "delayed":
        return fp8.delayed_scaling_policy(
            history_len=p.history_len,
            margin=config.policy.margin,
            fmt=config.model.fmt,
            reset_history=config.transients.reset_history_on_load,
        )
    if p.kind in ("rank_aware", "rank_agnostic"):
        rule = fp8.ScaleRule(
            seq_len=config.data.seq_len - 1,
            delta=config.policy.delta,
            gamma=p.gamma,
            rank_aware=p.kind == "rank_aware",
            fmt=config.model.fmt,
            calibration=config.policy.calibration,
        )
        policy = fp8.geometry_scaling_policy(rule, burn_in_iters=config.policy.burn_in_iters)
        if not p.online:
            return policy
        return fp8.online_calibration(
            policy,
            history=config.policy.online_history,
            margin=config.policy.online_margin,
            floor=config.policy.online_floor,
        )
    return current_scaling_policy()


def copy_batch(key: jax.Array, *, batch_size: int, seq_len: int, vocab_size: int):
    """Copy task: ``[a_1..a_k, a_1..a_k][:seq_len]``, ``k = ⌈seq_len/2⌉``; inputs, targets, mask."""
    k = (seq_len + 1) // 2
    first = jax.random.randint(key, (batch_size, k), 0, vocab_size)
    seq = jnp.concatenate([first, first], axis=1)[:, :seq_len]
    inputs, targets = seq[:, :-1], seq[:, 1:]
    mask = (jnp.arange(seq_len - 1) >= k - 1).astype(jnp.float32)[None].repeat(batch_size, 0)
    return inputs, targets, mask


class _KeyedData:
    """``fit``'s batch source when the step draws its data from its key: nothing to feed."""

    __next__ = state = lambda self: {}
    restore = lambda self, state: None


def make_model(config, *, quantize: bool = True) -> models.Fp8Transformer:
    arch = {k: config.model[k] for k in ("num_layers", "d_model", "num_heads", "mlp_dim", "fmt")}
    d = config.data
    return models.Fp8Transformer(d.vocab_size, max_len=d.seq_len, quantize=quantize, **arch)


def make_optimizer(config) -> optax.GradientTransformation:
    o = config.optim
    adamw = optax.inject_hyperparams(optax.adamw)
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        adamw(learning_rate=o.learning_rate, weight_decay=o.weight_decay),
    )


def learning_rates(config, num_steps: int, *, spikes: bool = True) -> np.ndarray:
    """Per-step learning rate ``(num_steps,)``: warm-up, then (``spikes``) the LR transient."""
    o, t = config.optim, config.transients
    out = []
    for step in range(num_steps):
        lr = o.learning_rate * min(1.0, (step + 1) / max(1, config.schedule.warmup_steps))
        if not spikes and step >= t.lr_spike_step:
            lr = o.learning_rate
        elif t.lr_spike_step <= step < t.lr_spike_step + t.lr_spike_steps:
            lr *= t.lr_spike_factor
        out.append(lr)
    return np.asarray(out, np.float32)


def make_train_step(p: Policy, config, *, transients: bool = True):
    """``(step_fn, tx, policy)`` for ``common.fit``; state ``{"params", "opt_state", "policy"}``.

    ``frozen`` holds ``"lr"`` (the per-step learning rates) and, with ``transients``, ``"donor"``
    (the parameters loaded at ``transients.load_step``).
    """
    model = make_model(config, quantize=p.kind != "none")
    policy, tx = make_policy(p, config), make_optimizer(config)
    d, t = config.data, config.transients
    geometry = lambda params: fp8_attention_geometry(params, num_layers=config.model.num_layers)
    kw = dict(d=config.model.d_model, head_dim=config.model.d_model // config.model.num_heads)
    kw.update(seq_len=d.seq_len - 1, delta=config.policy.delta)

    def loss_fn(params, batch, scales):
        inputs, targets, mask = batch
        logits, stats = model.apply({"params": params}, inputs, scales)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(ce * mask) / jnp.sum(mask), stats

    def step(state, frozen, batch, key):
        del batch  # the copy-task batch is drawn from the step's key
        params, opt_state, pstate = state["params"], state["opt_state"], state["policy"]
        if transients:  # W^Q spike, then another run's parameters (the policy is reset)
            spike = lambda q: q * t.q_spike_factor
            params = jax.lax.cond(
                state["step"] == t.q_spike_step,
                lambda p: scale_queries(p, spike),
                lambda p: p,
                params,
            )
            donor = frozen["donor"]
            params, opt_state, pstate = jax.lax.cond(
                state["step"] == t.load_step,
                lambda ps: (donor, tx.init(donor), policy.reset(ps[2], *geometry(donor))),
                lambda ps: ps,
                (params, opt_state, pstate),
            )
        wq, wk, gains = geometry(params)
        scales, pstate = policy.scales(pstate, wq, wk, gains)
        batch = copy_batch(key, batch_size=d.batch_size, seq_len=d.seq_len, vocab_size=d.vocab_size)
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, scales)
        clip_state, adam_state = opt_state
        hp = dict(adam_state.hyperparams, learning_rate=frozen["lr"][state["step"]])
        opt_state = (clip_state, adam_state._replace(hyperparams=hp))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        pstate = policy.observe(pstate, stats["amax"])
        metrics = {
            "loss": loss,
            "overflow": jnp.sum(stats["overflow"]),
            "utilisation": jnp.mean(stats["utilisation"]),
            "softmax_error": jnp.mean(stats["softmax_error"]),
            "amax": jnp.max(stats["amax"]),
            "scale": jnp.mean(stats["scale"]),
        }
        geo = pstate.inner if isinstance(pstate, OnlineCalibrationState) else pstate
        if isinstance(pstate, OnlineCalibrationState):  # κ: the online calibration factor
            base = fp8.logit_bound(
                geo.sigma, norm_gain=gains[:, None], gamma=p.gamma, rank_aware=p.kind == "rank_aware", **kw
            )  # fmt: skip
            cr = fp8.fp8_max(config.model.fmt) * config.policy.calibration
            metrics["online_kappa"] = jnp.max(cr / (scales * base))
        if isinstance(geo, GeometryScalingState):  # max|S| over the rank-aware bound
            bound = fp8.logit_bound(geo.sigma, norm_gain=gains[:, None], gamma=p.gamma, **kw)
            metrics["bound_ratio"] = jnp.max(stats["amax"] / bound)
        return {"params": params, "opt_state": opt_state, "policy": pstate}, metrics

    return step, tx, policy


def scale_queries(params, fn):
    """``params`` with every layer's query kernel replaced by ``fn(kernel)``."""
    out = dict(params)
    for name, block in params.items():
        if name.endswith("_attention") and "query" in block:
            out[name] = {**block, "query": {"kernel": fn(block["query"]["kernel"])}}
    return out


def run_setup(p: Policy, config, donor=None):
    """``(state, frozen, step, track)`` of a run: the donor (``donor=None``: float32 from
    ``seed + 1``, no transients) or a run under policy ``p`` with the transients; ``track``: the
    jitted σ-tracking evaluation of geometry policies, else None."""
    is_donor = donor is None
    n = config.transients.donor_steps if is_donor else config.schedule.num_steps
    step, tx, policy = make_train_step(p, config, transients=not is_donor)
    tokens = jnp.zeros((1, config.data.seq_len - 1), jnp.int32)
    params = make_model(config).init(jax.random.key(config.seed + is_donor), tokens, None)["params"]
    pkey = jax.random.split(jax.random.key(config.seed + 7))[0]
    geometry = fp8_attention_geometry(params, num_layers=config.model.num_layers)
    pstate = policy.init(pkey, *geometry)  # geometry: burn-in (eager: same bits as before)
    frozen = {"lr": learning_rates(config, n, spikes=not is_donor)}
    if not is_donor:
        frozen["donor"] = donor
    track = None
    if isinstance(pstate, (GeometryScalingState, OnlineCalibrationState)):

        @jax.jit
        def track(state, frozen):  # σ the next step will use vs the exact σ
            w = fp8_attention_geometry(state["params"], num_layers=config.model.num_layers)
            exact = fp8.attention_sigma_max(w[0], w[1])
            est = policy.scales(state["policy"], *w)[1]
            est = (est.inner if isinstance(est, OnlineCalibrationState) else est).sigma
            return {f"tracking/{TRACKING}": jnp.max(jnp.abs(est - exact) / exact)}

    state = {"params": params, "opt_state": tx.init(params), "policy": pstate, "step": 0}
    return state, frozen, step, track


def steps(config, mesh=None) -> list[common.Step]:
    """The donor's and every policy's ``fit`` step, and the σ tracking, on abstract inputs."""
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    out, donor = [], None
    for p in [Policy("none", "none"), *map(parse_policy, config.policies)]:
        (state, frozen), (step, track) = common.eval_shape_with_static(
            lambda d, p=p: _split_setup(run_setup(p, config, d)), donor
        )
        name = "donor" if donor is None else p.name
        out.append(common.fit_step(step, state, frozen, {}, mesh=mesh, name=name))
        if track is not None:
            after = {**state, "step": jax.ShapeDtypeStruct((), jnp.int32)}
            args = (common.placed(after, mesh), common.placed(frozen, mesh))
            out.append(common.Step(f"{p.name} tracking", track, args))
        donor = donor or state["params"]
    return out


def _split_setup(setup):
    state, frozen, step, track = setup
    return (state, frozen), (step, track)


def train_run(
    p: Policy, config, workdir: str, donor=None, *, options: common.TrainOptions
) -> common.FitResult:
    """One resumable run through ``common.fit`` (with ``options``): the donor (``donor=None``:
    float32 from ``seed + 1``, no transients) or a run under policy ``p`` with the transients."""
    is_donor = donor is None
    n = config.transients.donor_steps if is_donor else config.schedule.num_steps
    state, frozen, step, track = run_setup(p, config, donor)
    dkey = jax.random.split(jax.random.key(config.seed + 7))[1]
    name = "donor" if is_donor else os.path.join("policies", p.name.replace(":", "_"))
    return common.fit(
        state,
        frozen,
        step,
        _KeyedData(),
        key=jax.random.key(config.seed + 1001) if is_donor else dkey,
        num_steps=n,
        workdir=os.path.join(workdir, name),
        log_every=n if is_donor else 1,
        eval_fn=track,
        eval_every=1 if track else 0,
        ckpt_every=config.ckpt.every,
        progress=config.log.progress,
        description=p.name,
        options=options,
    )


def check_config(config) -> None:
    """Validates the config before anything runs (raises ``common.ConfigError``)."""
    c = common
    for path in (  # noqa: SIM905
        "data.batch_size data.seq_len data.vocab_size model.num_layers model.d_model "
        "model.num_heads model.mlp_dim schedule.num_steps eval.window eval.final_loss_steps "
        "policy.burn_in_iters ckpt.every"
    ).split():
        c.check_positive(config, path, integer=True)
    c.check_divisible(
        config, "model.d_model", config.model.num_heads, why="d_model = heads x head_dim"
    )
    c.check_choice(config, "model.fmt", ("e4m3", "e5m2"))
    c.check_fraction(config, "policy.delta", allow_zero=False)
    c.check_positive(config, "policy.calibration")
    c.check_positive(config, "policy.online_history", integer=True)
    if not config.policy.online_margin >= 1 or not 0 < config.policy.online_floor <= 1:
        raise c.ConfigError(
            f"policy.online_margin={config.policy.online_margin} must be >= 1 and "
            f"policy.online_floor={config.policy.online_floor} in (0, 1]"
        )
    if not config.policies:
        raise c.ConfigError(
            "config.policies is empty: name at least one policy, e.g. ('delayed:16',)"
        )
    for p in config.policies:
        parse_policy(p)
    if config.data.seq_len < 4:
        raise c.ConfigError(f"config.data.seq_len={config.data.seq_len} is invalid: must be >= 4")


def run(config, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs every policy in ``config.policies`` (resuming finished ones) and writes the outputs."""
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    workdir = os.fspath(workdir)
    common.write_config_json(workdir, config)
    t0 = time.time()
    donor = train_run(Policy("none", "none"), config, workdir, options=options)
    all_series, n = {}, config.schedule.num_steps
    for name in config.policies:
        logging.info("fp8_attention: policy %s", name)
        result = (
            donor
            if donor.interrupted
            else train_run(
                parse_policy(name), config, workdir, donor.state["params"], options=options
            )
        )
        if result.interrupted:  # Ctrl-C: fit saved a checkpoint; rerun to resume
            return {"interrupted": True}
        series = all_series[name] = {k: np.full(n, np.nan) for k in (*METRICS, TRACKING)}
        for record in result.history:  # train and tracking records for steps 1..n
            for key, k in [(f"train/{k}", k) for k in METRICS] + [
                (f"tracking/{TRACKING}", TRACKING)
            ]:
                if key in record and 1 <= record["step"] <= n:
                    series[k][record["step"] - 1] = record[key]

    writer = common.MetricWriter(workdir, tensorboard=config.log.tensorboard)
    for s in range(config.schedule.num_steps):
        record = {f"{n}/{k}": v[k][s] for n, v in all_series.items() for k in v}
        writer.write(s, {k: v for k, v in record.items() if np.isfinite(v)})
    writer.close()
    plots = plot_timelines(workdir, all_series, config)

    rows = [summarise(name, series, config) for name, series in all_series.items()]
    geo = [r for r in rows if r["policy"].startswith("rank_")]
    delayed = [r for r in rows if r["policy"].startswith("delayed")]
    tight = tightness_rows()
    text = notes(config, tight)
    common.write_results_md(
        workdir, rows, title="FP8 attention logits under transients (P14)", notes=text
    )
    ratios = [r["max abs(S) / bound"] for r in rows if r["max abs(S) / bound"] != ""]
    result = {
        "geometry_overflows": int(sum(r["overflows (total)"] for r in geo)),
        "delayed_overflows": int(sum(r["overflows (total)"] for r in delayed)),
        "delayed_overflows_after_q_spike": int(sum(r["after Q spike"] for r in delayed)),
        "max_bound_ratio": max(ratios, default=float("nan")),
        "max_sigma_track_err": max(
            (r["σ tracking err (max)"] for r in geo if r["σ tracking err (max)"] != ""),
            default=float("nan"),
        ),
        "final_loss": {r["policy"]: r["final loss"] for r in rows},
        "steady_softmax_error": {r["policy"]: r["steady softmax err"] for r in rows},
        "steady_utilisation": {r["policy"]: r["steady utilisation"] for r in rows},
        "plots": [os.path.basename(p) for p in plots],
        "runtime_s": time.time() - t0,
    }
    common.write_json(os.path.join(workdir, "results.json"), {"rows": rows, **result})
    return result
