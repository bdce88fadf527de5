r"""P16 TFFT: tail-aware flow fine-tuning for CVaR, against expected-reward fine-tuning and the
iterative CVaR baseline, at matched KL (configs/tfft.py describes the study).

``run(config, workdir)``, per source (``ring``, ``mnist``) and seed:

1. pre-trains a flow-matching MLP through ``experiments.common.fit`` (checkpointed under
   ``<workdir>/pretrain-<source>-seed<s>/``, so an interrupted run resumes there);
2. draws ``tfft.num_stage1`` pre-trained samples and, per method, chooses ``α`` so that the
   target ``p* ∝ p_pre·exp(r̃/α)`` is ``tfft.kl_target`` nats from the pre-trained law, then
   fine-tunes towards it by adjoint matching on ``∇(r̃/α)`` (``generative.train_adjoint_matching``,
   ``tfft.stage2="adjoint"``) or by flow matching on the importance-resampled samples
   (``generative.train_flow``, ``"resample"``: it can only reweight those samples);
   the iterative baseline repeats sample → quantile → tilt → fine-tune ``tfft.rounds`` times with
   a per-round target of ``kl_target / K²`` (small tilts add up in the exponent, so K of them
   reach about ``kl_target``; the measured KL is reported next to it);
3. evaluates ``eval.num_samples`` samples: mean reward, CVaR_L and CVaR_R at β, the target's KL,
   the learned model's KL from the pre-trained flow (``generative.flow_kl``: exact ODE
   log-likelihoods on ``eval.kl_samples`` samples), a 2-D histogram KL to the pre-trained samples
   (ring only) and the wall and CPU time of step 2
   (stage 1 included; the CPU time is the steadier column on a shared machine);
4. with ``tfft.alpha_grid`` (or ``tfft.alpha_grid_by_source``), repeats 2-3 at those multiples
   of each method's ``α`` and compares the methods at budgets of *measured* KL
   (``eval.kl_budgets``; ``frontier.md``, ``kl_frontier_<source>.png``).

Each (source, seed, method) is a cell (``cells/<key>.json``; a rerun reads finished cells back).
:mod:`experiments.common.tfft_report` writes ``results.md`` / ``summary.json`` (table and the
trend checks of specs.md §16), ``rewards_<source>.png`` (reward histograms, seed 0) and
``ring_samples.png``.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from experiments import common
from experiments.common import sweep
from experiments.common import tfft_report as report
from lowrank_jax import generative as gen
from lowrank_jax.data import BatchIterator, load_mnist
from lowrank_jax.generative.flows import flow_matching_loss

__all__ = ["METHODS", "check_config", "mnist_source", "ring_source", "run"]

METHODS = ("pretrained", "expected", "tfft_left", "tfft_right", "iterative_right")
SOURCES = ("ring", "mnist")
STAGE2 = ("adjoint", "resample")  # adjoint matching (default) or flow matching on resampled samples
# The ring: 8 modes at radius 4 (angle 45°·i), std 0.35, unequal weights; mode 2 (90°) is the rare
# high-reward mode (5%), mode 4 (180°) the failure mode (10% of the mass: the lower β = 0.1 tail).
RING_WEIGHTS = (0.22, 0.18, 0.05, 0.15, 0.10, 0.12, 0.10, 0.08)
RING_RARE, RING_FAIL = 2, 4


def check_config(config: Any) -> None:
    """Validates the config before anything is computed."""
    c = common
    seeds = c.get_path(config, "seeds")
    if not seeds or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise c.ConfigError(f"config.seeds={seeds!r} is invalid: a non-empty tuple of ints >= 0")
    for name, allowed in (("sources", SOURCES), ("methods", METHODS)):
        values = c.get_path(config, name)
        if not values or any(v not in allowed for v in values):
            raise c.ConfigError(
                f"config.{name}={values!r} is invalid: a non-empty tuple from {allowed}"
            )
    c.check_fraction(config, "tfft.beta", allow_zero=False)
    c.check_positive(config, "tfft.kl_target")
    c.check_choice(config, "tfft.stage2", STAGE2)
    c.check_positive(config, "tfft.time_steps", integer=True)
    for m in config.methods:
        if m != "pretrained":
            c.check_positive(config, f"tfft.alpha_scale.{m}")
    report.check_config(config, SOURCES)
    for key in ("eval.kl_samples", "eval.kl_steps"):
        c.check_positive(config, key, integer=True)
    for key in ("tfft.rounds", "tfft.num_stage1", "eval.num_samples", "model.sample_steps"):
        c.check_positive(config, key, integer=True)
    for key in ("pretrain_steps", "finetune_steps", "batch_size"):
        c.check_positive(config, f"schedule.{key}", integer=True)
    c.check_positive_ints(config, "model.ring_features")
    c.check_positive_ints(config, "model.mnist_features")
    c.check_positive(config, "optim.learning_rate")
    c.check_positive(config, "optim.finetune_learning_rate")
    c.check_positive(config, "log.every", integer=True)
    c.check_choice(config, "data.digit", tuple(range(10)))
    if not 1 <= c.check_positive(config, "data.pca_dim", integer=True) <= 784:
        raise c.ConfigError(f"config.data.pca_dim={config.data.pca_dim} is invalid: 1..784")
    c.check_nonnegative(config, "data.mnist_limit", integer=True)
    c.check_positive(config, "data.ring_train", integer=True)


# ----------------------------------------------------------------------------------------------
# Sources: pre-training data and a reward.


def ring_source(config: Any) -> dict[str, Any]:
    """The 2-D ring: ``{"name", "train" (N, 2) float32, "reward" (jitted x -> r), "features"}``."""
    angles = 2 * np.pi * np.arange(8) / 8
    centres = 4.0 * np.stack([np.cos(angles), np.sin(angles)], -1).astype(np.float32)
    rng = np.random.default_rng(1234)
    modes = rng.choice(8, size=config.data.ring_train, p=RING_WEIGHTS)
    train = centres[modes] + 0.35 * rng.standard_normal((len(modes), 2)).astype(np.float32)
    rare, fail = jnp.asarray(centres[RING_RARE]), jnp.asarray(centres[RING_FAIL])

    def reward(x):
        bump = lambda c: jnp.exp(-jnp.sum((x - c) ** 2, -1) / (2 * 0.5**2))  # noqa: E731
        return x[:, 0] / 4 + 3 * bump(rare) - 3 * bump(fail)

    return {"name": "ring", "train": train, "reward": jax.jit(reward), "features": "ring_features"}


def mnist_source(config: Any) -> dict[str, Any]:
    """One digit of MNIST in the (standardised) ``data.pca_dim``-d PCA space of all digits, and
    the reward ``log p(digit | x)`` of a logistic regression fitted on all ten digits there."""
    from sklearn.linear_model import LogisticRegression

    ds = load_mnist("train")
    x, y = ds.x.reshape(len(ds.x), -1).astype(np.float64), np.asarray(ds.y)
    if config.data.mnist_limit:
        x, y = x[: config.data.mnist_limit], y[: config.data.mnist_limit]
    mean = x.mean(0)
    _, vecs = np.linalg.eigh(np.cov(x - mean, rowvar=False))
    comps = vecs[:, ::-1][:, : config.data.pca_dim]
    z = (x - mean) @ comps
    z = (z / z.std()).astype(np.float32)
    clf = LogisticRegression(max_iter=300).fit(z, y)
    w, b = jnp.asarray(clf.coef_.T, jnp.float32), jnp.asarray(clf.intercept_, jnp.float32)
    digit = config.data.digit

    def reward(x):
        return jax.nn.log_softmax(x @ w + b)[:, digit]

    train = z[y == digit]
    return {
        "name": "mnist",
        "train": train,
        "reward": jax.jit(reward),
        "features": "mnist_features",
    }


# ----------------------------------------------------------------------------------------------
# Pre-training (resumable) and the fine-tuning methods.


def _flow_setup(config: Any, features: str, dim: int, seed: int):
    """``(net, state, step)``: the velocity MLP (``config.model[features]``) on ``dim``-d points,
    its pre-training state and flow-matching ``fit`` step."""
    net = gen.VelocityMLP(features=tuple(config.model[features]))
    params = net.init(jax.random.key(seed), jnp.zeros((1, dim)), 0.0)
    tx = optax.adam(config.optim.learning_rate)

    def step(state, frozen, batch, key):
        del frozen
        loss, g = jax.value_and_grad(flow_matching_loss)(
            state["params"], net.apply, key, batch["x"]
        )
        updates, opt_state = tx.update(g, state["opt_state"], state["params"])
        return {
            **state,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }, {"loss": loss}

    return net, {"params": params, "opt_state": tx.init(params), "step": 0}, step


_SOURCE_DIMS = {"ring": lambda config: 2, "mnist": lambda config: config.data.pca_dim}
_SOURCE_FEATURES = {"ring": "ring_features", "mnist": "mnist_features"}
# Data-free stand-ins of the rewards (same shapes) for the abstract steps.
_ABSTRACT_REWARDS = {"ring": lambda x: x[:, 0], "mnist": lambda x: -jnp.sum(x**2, -1)}


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """Per source, on abstract inputs (no data): the pre-training ``fit`` step, the sampler and
    the fine-tuning (``generative.train_adjoint_matching``, or ``train_flow`` when
    ``tfft.stage2="resample"``)."""
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    spec, key = jax.ShapeDtypeStruct, jax.eval_shape(lambda: jax.random.key(0))
    out = []
    for name in config.sources:
        dim = _SOURCE_DIMS[name](config)
        state, (net, step) = common.eval_shape_with_static(
            lambda name=name, dim=dim: _split(_flow_setup(config, _SOURCE_FEATURES[name], dim, 0))
        )
        batch = {"x": spec((config.schedule.batch_size, dim), jnp.float32)}
        out.append(common.fit_step(step, state, None, batch, mesh=mesh, name=f"{name} pre-training"))  # fmt: skip
        n = config.tfft.num_stage1
        sampler = jax.jit(lambda p, k, net=net, n=n: _sample(config, net, p, k, n))
        out.append(common.Step(f"{name} sampler", sampler, (state["params"], key)))
        tx = _finetune_tx(config.optim.finetune_learning_rate)
        b, n_ft = config.schedule.batch_size, config.schedule.finetune_steps
        if config.tfft.stage2 == "resample":
            kw = dict(apply_fn=net.apply, tx=tx, num_steps=n_ft, batch_size=b)
            args = (state["params"], spec((n, dim), jnp.float32), spec((n,), jnp.float32), key)
            out.append(common.Step(f"{name} fine-tuning", gen.train_flow, args, kw))
        else:
            reward = _ABSTRACT_REWARDS[name]
            log_tilt = gen.reward_log_tilt(reward, beta=config.tfft.beta, tail="right")
            kw = dict(apply_fn=net.apply, log_tilt=log_tilt, tx=tx, dim=dim, num_steps=n_ft,
                      batch_size=b, time_steps=config.tfft.time_steps)  # fmt: skip
            tilt_args = {"eta": spec((), jnp.float32), "alpha": spec((), jnp.float32)}
            args = (state["params"], state["params"], tilt_args, key)
            out.append(common.Step(f"{name} fine-tuning", gen.train_adjoint_matching, args, kw))
    return out


def _split(setup):
    net, state, step = setup
    return state, (net, step)


def _pretrain(config: Any, src: dict[str, Any], seed: int, workdir: str, options):
    dim = src["train"].shape[1]
    net, state, step = _flow_setup(config, src["features"], dim, seed)
    steps = config.schedule.pretrain_steps
    result = common.fit(
        state,
        None,
        step,
        BatchIterator({"x": src["train"]}, batch_size=config.schedule.batch_size, seed=seed),
        key=jax.random.key(seed + 1),
        num_steps=steps,
        workdir=os.path.join(workdir, f"pretrain-{src['name']}-seed{seed}"),
        log_every=min(config.log.every, steps),
        ckpt_every=max(1, steps // 4),
        description=f"pre-train {src['name']} seed {seed}",
        options=options,
    )
    return net, result.state["params"]


def _finetune(config: Any, net, params, tilt: dict[str, Any], key):
    """Stage 2 from ``params`` towards ``p ∝ p_params·exp(r̃/α)``: adjoint matching on the tilt's
    gradient (``tfft.stage2="adjoint"``) or flow matching on the importance-resampled samples
    (``"resample"``). ``tilt``: ``samples``, ``r_tilde`` (on them), ``alpha``, ``mode``
    (``expected``/``left``/``right``), ``eta`` and the reward."""
    s = config.schedule
    tx = _finetune_tx(config.optim.finetune_learning_rate)
    if config.tfft.stage2 == "resample":
        log_weights = tilt["r_tilde"] / tilt["alpha"]
        return gen.train_flow(params, tilt["samples"], log_weights, key, apply_fn=net.apply,
                              tx=tx, num_steps=s.finetune_steps, batch_size=s.batch_size)[0]  # fmt: skip
    args = {"eta": jnp.float32(tilt["eta"]), "alpha": jnp.float32(tilt["alpha"])}
    tail = None if tilt["mode"] == "expected" else tilt["mode"]
    log_tilt = gen.reward_log_tilt(tilt["reward"], beta=config.tfft.beta, tail=tail)
    return gen.train_adjoint_matching(
        params, params, args, key, apply_fn=net.apply, log_tilt=log_tilt, tx=tx,
        dim=tilt["samples"].shape[1], num_steps=s.finetune_steps, batch_size=s.batch_size,
        time_steps=config.tfft.time_steps)[0]  # fmt: skip


@functools.cache
def _finetune_tx(learning_rate: float) -> optax.GradientTransformation:
    return optax.adam(learning_rate)  # one object per rate, so train_flow compiles once


def _sample(config: Any, net, params, key, num: int) -> jax.Array:
    dim = params["params"]["head"]["kernel"].shape[-1]
    return gen.sample_flow(
        net.apply, params, key, num=num, dim=dim, num_steps=config.model.sample_steps
    )


def _method(
    config, method, src, net, pre_params, key, multiple: float = 1.0
) -> tuple[Any, dict[str, Any]]:
    """Fine-tuned parameters of ``method`` and its ``α`` / ``η*`` / target KL; ``multiple`` scales
    ``α`` beyond ``tfft.alpha_scale`` (a point of the KL frontier, ``tfft.alpha_grid``)."""
    t = config.tfft
    beta, reward = t.beta, src["reward"]
    if method == "pretrained":
        return pre_params, {}
    if method == "iterative_right":
        params, alphas = pre_params, []
        for k in range(t.rounds):
            ks, kf = jax.random.split(jax.random.fold_in(key, k))
            samples = _sample(config, net, params, ks, t.num_stage1)
            r = reward(samples)
            q = jnp.quantile(r, 1.0 - beta)  # the current model's tail quantile
            r_tilde = gen.pseudo_reward(r, q, beta=beta, tail="right")
            alpha, r_tilde = gen.tilt_for_kl(
                lambda a, r_tilde=r_tilde: r_tilde,
                target_kl=t.kl_target / t.rounds**2,
                bounds=(1e-3, 1e3),
            )
            alpha *= t.alpha_scale[method] * multiple
            tilt = dict(samples=samples, r_tilde=r_tilde, alpha=alpha, mode="right", eta=q,
                        reward=reward)  # fmt: skip
            params = _finetune(config, net, params, tilt, kf)
            alphas.append(alpha)
        return params, {"alpha": float(np.mean(alphas))}
    ks, kf = jax.random.split(key)
    samples = _sample(config, net, pre_params, ks, t.num_stage1)
    r = reward(samples)
    info = {}
    if method == "expected":
        pseudo = lambda a: r  # noqa: E731
        mode = "expected"
    else:
        mode = method.removeprefix("tfft_")

        def pseudo(a):
            eta = gen.cvar_threshold(r, beta=beta, alpha=a, tail=mode)
            info["eta"] = float(eta)
            return gen.pseudo_reward(r, eta, beta=beta, tail=mode)

    alpha, _ = gen.tilt_for_kl(pseudo, target_kl=t.kl_target, bounds=(1e-3, 1e3))
    alpha *= t.alpha_scale[method] * multiple
    r_tilde = pseudo(alpha)
    target_kl = float(gen.tilt_kl(gen.tilt_weights(r_tilde, alpha=alpha)))
    tilt = dict(samples=samples, r_tilde=r_tilde, alpha=alpha, mode=mode,
                eta=info.get("eta", 0.0), reward=reward)  # fmt: skip
    params = _finetune(config, net, pre_params, tilt, kf)
    return params, {**info, "alpha": alpha, "target_kl": target_kl}


def _histogram_kl(x: np.ndarray, ref: np.ndarray, bins: int = 40, eps: float = 1e-4) -> float:
    """``KL(p‖q)`` of two 2-D samples on a ``bins²`` grid over [-6, 6]², both smoothed by ``eps``."""
    edges = np.linspace(-6, 6, bins + 1)
    p = np.histogram2d(x[:, 0], x[:, 1], bins=[edges, edges])[0].ravel() + eps * len(x)
    q = np.histogram2d(ref[:, 0], ref[:, 1], bins=[edges, edges])[0].ravel() + eps * len(ref)
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def _cell(config, method, multiple, src, seed, net, pre_params, pre_eval) -> dict[str, Any]:
    key = jax.random.fold_in(jax.random.key(seed), METHODS.index(method) + 10)  # same at every α
    start, cpu_start = time.perf_counter(), time.process_time()
    params, info = _method(config, method, src, net, pre_params, key, multiple)
    params = jax.block_until_ready(params)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    x = np.asarray(_sample(config, net, params, jax.random.key(10_000 + seed), pre_eval.shape[0]))
    r = src["reward"](jnp.asarray(x))
    beta = config.tfft.beta
    out = {
        "mean": float(jnp.mean(r)),
        "cvar_left": float(gen.cvar(r, beta=beta, tail="left")),
        "cvar_right": float(gen.cvar(r, beta=beta, tail="right")),
        "seconds": seconds if method != "pretrained" else 0.0,
        "cpu_seconds": cpu_seconds if method != "pretrained" else 0.0,
        "rewards": np.asarray(r)[:2000].tolist(),
        **info,
        "alpha_multiple": multiple,
    }
    if method != "pretrained":  # the learned model's KL, by the flows' exact log-likelihoods
        kl, se = gen.flow_kl(net.apply, params, pre_params, jax.random.key(20_000 + seed),
                             num=config.eval.kl_samples, dim=x.shape[1],
                             num_steps=config.eval.kl_steps)  # fmt: skip
        out["model_kl"], out["model_kl_se"] = float(kl), float(se)
    if src["name"] == "ring":
        out["hist_kl"] = _histogram_kl(x, pre_eval)
        out["samples"] = x[:1000].tolist()
    return out


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    store = sweep.CellStore(workdir, options=options)
    builders = {"ring": ring_source, "mnist": mnist_source}
    total = sum(len(report.method_runs(config, s)) for s in config.sources) * len(config.seeds)
    bar = tqdm(total=total, desc="tfft cells", disable=None)
    warm = set()
    for name in config.sources:
        runs = report.method_runs(config, name)  # (method, α multiple), the plain ones first
        src = None
        for seed in config.seeds:
            keys = [report.cell_key(name, seed, m, g) for m, g in runs]
            if all(k in store for k in keys):
                for k in keys:
                    store.get(k, dict)  # read back
                bar.update(len(keys))
                continue
            src = src or builders[name](config)
            net, pre = _pretrain(config, src, seed, workdir, options)
            pre_eval = np.asarray(
                _sample(config, net, pre, jax.random.key(10_000 + seed), config.eval.num_samples)
            )
            if name not in warm:  # compile sampler, threshold and fine-tune outside the timings
                _method(config, "tfft_left", src, net, pre, jax.random.key(0))
                warm.add(name)
            args = (src, seed, net, pre, pre_eval)
            for (m, g), k in zip(runs, keys, strict=True):
                store.get(k, lambda m=m, g=g, args=args: _cell(config, m, g, *args))
                bar.update()
    bar.close()
    store.close()
    return report.write_results(config, workdir, store.cells)
