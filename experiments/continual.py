"""Continual learning with LoRA: SABER, GR-LoRA and the baselines on one task stream.

The family behind ``configs/saber.py`` and ``configs/gr_lora.py``. A frozen backbone (the top
layers of the pretrained MiniLM on cached hidden states, a ViT or an MLP pretrained on a base
session, or random features; streams and backbones: :mod:`experiments.continual_setup`) learns a
stream of tasks with one LoRA branch per task on the kernels matching ``config.adapter.targets``
plus a shared linear head (trained on the current task's classes only: masked cross-entropy).
After each task the branch is *consolidated* by the method:

* ``seq_lora``: merged into the kernels (no protection: the lower bound);
* ``o_lora``: merged; later ``A`` factors are pushed off earlier ones (``λ Σ‖A_iᵀA_t‖²``);
* ``inflora``: ``A_t`` fixed to new-task input directions off the GPM memory, ``B_t`` trained;
* ``gpm_lora``: ``A_t`` trained with :func:`lowrank_jax.optim.scale_by_orthogonal_projection`;
* ``sd_lora``: stored as a unit direction with a learnable magnitude;
* ``saber``: decomposed into shared and orthogonal task-specific parts and recomposed with
  energy-aware balancing (:mod:`lowrank_jax.continual.saber`, reconstruction);
* ``gr_lora``: the projected part merged, the recycled part
  (:func:`lowrank_jax.optim.scale_by_gradient_recycling`) kept as a task module, selected at test
  time by entropy (:mod:`lowrank_jax.continual.gr_lora`, reconstruction);
* ``joint``: one LoRA trained on all tasks at once (the upper bound; only the final row of the
  accuracy matrix is meaningful).

Every method runs through ``experiments.common.fit`` once per task, in
``<workdir>/<method>/seed_<s>/task_<t>``: an interrupted run resumes inside the task where it
stopped, and the finished tasks are replayed from their final checkpoints (consolidation is
deterministic). Outputs in the workdir: ``results.md`` (the table of all methods, mean ± sd over
seeds), ``accuracy_matrices.json``, ``acc_matrix_<method>.png``, ``plasticity.png``,
``memory_fill.png``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import common
from experiments.continual_setup import (
    BENCHMARKS,
    MODELS,
    PROTOCOLS,
    Stream,
    build_backbone,
    load_stream,
    optimizer,
)
from lowrank_jax import adapters, continual, data
from lowrank_jax import optim as lj_optim

METHODS = ("saber", "gr_lora", "seq_lora", "o_lora", "inflora", "gpm_lora", "sd_lora", "joint")
_MEMORY_METHODS = ("inflora", "gpm_lora", "gr_lora")


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed.

    Raises:
      experiments.common.ConfigError: naming the first bad key, its value and what is allowed.
    """
    c = common
    seeds = c.get_path(config, "seeds")
    if (
        isinstance(seeds, int | str)
        or not seeds
        or any(not isinstance(s, int) or s < 0 for s in seeds)
    ):
        raise c.ConfigError(
            f"config.seeds={seeds!r} is invalid: must be a non-empty tuple of ints >= 0, e.g. (0, 1, 2)"
        )
    methods = c.get_path(config, "methods")
    if isinstance(methods, str) or not methods:
        raise c.ConfigError(
            f"config.methods={methods!r} is invalid: must be a non-empty tuple of method names "
            f"from {', '.join(METHODS)}"
        )
    for m in methods:
        if m not in METHODS:
            raise c.ConfigError(
                f"config.methods has {m!r}: allowed values are {', '.join(METHODS)}"
            )
    benchmark = c.check_choice(config, "data.benchmark", BENCHMARKS)
    c.check_positive(config, "data.batch_size", integer=True)
    c.check_positive(config, "data.num_tasks", integer=True)
    if benchmark == "long_stream":
        c.check_positive(config, "data.classes_per_task", integer=True)
        c.check_positive(config, "data.separation")
    if benchmark == "shakespeare_plays":
        for key in ("plays_per_task", "passage_chars", "seq_len", "train_per_class"):
            c.check_positive(config, f"data.{key}", integer=True)
        c.check_positive(config, "data.test_per_class", integer=True)
        plays = c.get_path(config, "data.plays")
        unknown = sorted(set(plays) - set(data.PLAYS)) if not isinstance(plays, str) else [plays]
        if unknown or len(set(plays)) != len(plays):
            raise c.ConfigError(
                f"config.data.plays={plays!r} is invalid: distinct play keys from "
                f"{', '.join(data.PLAYS)}"
            )
        if config.data.plays_per_task < 2:
            raise c.ConfigError("config.data.plays_per_task must be >= 2 (a task needs 2 classes)")
        need = config.data.plays_per_task * config.data.num_tasks
        if len(plays) < need:
            raise c.ConfigError(
                f"config.data.plays has {len(plays)} plays; {config.data.num_tasks} tasks x "
                f"{config.data.plays_per_task} plays per task need {need}: add plays or lower "
                "config.data.num_tasks"
            )
        if config.data.seq_len > 512:
            raise c.ConfigError(
                f"config.data.seq_len={config.data.seq_len} is invalid: MiniLM takes <= 512 tokens"
            )
    if benchmark == "split_mnist":
        c.check_positive(config, "data.train_per_class", integer=True)
        if config.data.num_tasks not in (2, 3):
            raise c.ConfigError(
                f"config.data.num_tasks={config.data.num_tasks} is invalid for split_mnist: the "
                "base session (0-4) plus 1 or 2 increments over 5-9 (each needs >= 2 classes)"
            )
    name = c.check_choice(config, "model.name", MODELS)
    wanted = {"shakespeare_plays": "minilm", "split_mnist": "vit"}.get(benchmark, "mlp")
    if name != wanted:
        raise c.ConfigError(
            f"config.model.name={name!r} does not fit benchmark {benchmark!r}: use {wanted!r}"
        )
    if name == "mlp":
        feats = c.get_path(config, "model.features")
        if isinstance(feats, int) or any(not isinstance(f, int) or f < 1 for f in feats):
            raise c.ConfigError(
                f"config.model.features={feats!r} is invalid: a tuple of positive ints"
            )
    if name == "vit":
        for key in ("patch", "dim", "depth", "heads", "mlp_dim"):
            c.check_positive(config, f"model.vit.{key}", integer=True)
        c.check_divisible(config, "model.vit.dim", config.model.vit.heads, why="heads split dim")
    if name == "minilm":
        first = c.get_path(config, "model.first_layer")
        if isinstance(first, bool) or not isinstance(first, int) or not 1 <= first <= 5:
            raise c.ConfigError(
                f"config.model.first_layer={first!r} is invalid: the first adapted MiniLM layer, "
                "1..5 (layers below it are frozen and cached)"
            )
    c.check_nonnegative(config, "model.pretrain_steps", integer=True)
    c.check_positive(config, "adapter.rank", integer=True)
    c.check_positive(config, "adapter.alpha")
    targets = c.get_path(config, "adapter.targets")
    if isinstance(targets, str) or not targets:
        raise c.ConfigError(
            f"config.adapter.targets={targets!r} is invalid: a non-empty tuple of regexes"
        )
    c.check_positive(config, "optim.learning_rate")
    c.check_nonnegative(config, "optim.grad_clip")
    c.check_positive(config, "schedule.steps_per_task", integer=True)
    m = config.method
    for key in ("memory_threshold", "saber.shared_threshold", "saber.specific_threshold"):
        v = c.get_path(m, key)
        if not 0 < v <= 1:
            raise c.ConfigError(f"config.method.{key}={v!r} is invalid: must lie in (0, 1]")
    c.check_positive(config, "method.memory_examples", integer=True)
    c.check_nonnegative(config, "method.o_lora.lambda_orth")
    c.check_nonnegative(config, "method.saber.lambda_align")
    c.check_nonnegative(config, "method.saber.gamma")
    if not 0 < m.saber.min_weight <= 1:
        raise c.ConfigError(
            f"config.method.saber.min_weight={m.saber.min_weight!r} is invalid: in (0, 1]"
        )
    c.check_choice(config, "method.saber.shared_mode", ("balanced", "mean"))
    c.check_nonnegative(config, "method.saber.energy_strength")
    c.check_nonnegative(config, "method.saber.recalibrate_steps", integer=True)
    c.check_nonnegative(config, "method.gr_lora.lambda_local")
    c.check_nonnegative(config, "method.gr_lora.lambda_global")
    c.check_nonnegative(config, "method.gr_lora.recycle_scale")
    c.check_positive(config, "method.gr_lora.ood_batch", integer=True)
    if "saber" in methods and config.adapter.rank < 2:
        raise c.ConfigError(
            "config.adapter.rank must be >= 2 for saber (half shared, half specific)"
        )
    c.check_positive(config, "eval.batch_size", integer=True)
    c.check_positive(config, "ckpt.max_to_keep", integer=True)
    c.check_positive(config, "log.every", integer=True)


# ----------------------------------------------------------------------------------------------
# Helpers.


def _kernel_paths(variables: Any, targets: tuple[str, ...]) -> list[str]:
    names = adapters.named_leaves(variables)
    out = [n for n in names if any(re.fullmatch(t, n) for t in targets)]
    if not out:
        raise common.ConfigError(
            f"config.adapter.targets={targets!r} match no kernel; the paths are {list(names)}"
        )
    return out


def _get(tree: Any, path: str) -> Any:
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _set(tree: Any, path: str, value: Any) -> Any:
    head, _, rest = path.partition("/")
    out = dict(tree)
    out[head] = value if not rest else _set(tree[head], rest, value)
    return out


def _with_head(params: Any, head: Any) -> Any:
    return _set(params, "params/head", head)


def _lora_set(key: jax.Array, variables: Any, config: Any, rank: int) -> dict[str, Any]:
    alpha = config.adapter.alpha * rank / config.adapter.rank
    rules = [(t, adapters.lora(rank, alpha=alpha)) for t in config.adapter.targets]
    return adapters.init(key, variables, rules)


def _replace_a(lora_set: dict[str, Any], new_a: Mapping[str, jax.Array]) -> dict[str, Any]:
    return {
        p: ad.replace(factors={**ad.factors, "a": new_a[p].astype(ad.factors["a"].dtype)})
        for p, ad in lora_set.items()
    }


def _masked_ce(logits: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    z = jnp.where(mask, logits, -1e9)
    return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()


# ----------------------------------------------------------------------------------------------
# One method on one stream.


@dataclasses.dataclass
class _Task:
    """What the training step of one task needs (built per method)."""

    trainable: dict[str, Any]
    frozen: dict[str, Any]
    tx: Any
    penalty: Callable[[dict[str, Any], dict[str, Any]], jax.Array] | None = None
    forward: Callable[..., jax.Array] | None = None  # (trainable, frozen, x) -> logits
    ood: Callable[..., jax.Array] | None = None  # (trainable, frozen, key) -> loss


class Learner:
    """One method's continual state over a stream, consolidated after each task.

    Attributes (the continual state, all host pytrees): ``params`` (kernels with the merged /
    recomposed updates and the head), ``memory`` ``{kernel path: SubspaceMemory}`` and
    method-specific records (``old_a``, ``dirs``/``alphas``, ``saber``, ``modules``, ``stats``).
    """

    def __init__(self, config: Any, method: str, model: Any, variables: Any, stream: Stream):
        self.config, self.method, self.model, self.stream = config, method, model, stream
        self.apply = adapters.adapt(model.apply)
        self.params = variables
        self.kernels = _kernel_paths(variables, tuple(config.adapter.targets))
        self.w0 = {k: jnp.asarray(_get(variables, k)) for k in self.kernels}
        self.memory = {k: lj_optim.init_subspace_memory(self.w0[k].shape[0]) for k in self.kernels}
        self.old_a = {
            k: jnp.zeros((0, self.w0[k].shape[0], config.adapter.rank)) for k in self.kernels
        }
        self.dirs = {k: jnp.zeros((0, *self.w0[k].shape)) for k in self.kernels}
        self.alphas = {k: jnp.zeros((0,)) for k in self.kernels}
        self.shared_mem = dict(self.memory)
        self.spec_mem = dict(self.memory)
        self.saber_parts = {k: ([], []) for k in self.kernels}
        self.saber_weights: dict[str, Any] = {}
        self.old_cov = {k: jnp.zeros((self.w0[k].shape[0],) * 2) for k in self.kernels}
        self.modules: list[dict[str, Any]] = []
        self.stats: continual.ClassStatistics | None = None
        self.recycled_fraction: list[float] = []
        self.memory_fill: list[float] = []
        self.task_updates: list[np.ndarray] = []  # flattened ΔW_t over the kernels, per task
        # compiled once per learner (the parameters are arguments, not constants)
        self._jit_layer_inputs = jax.jit(
            lambda p, x: continual.layer_inputs(model.apply, self.kernels, p, x)
        )
        self._jit_plain = jax.jit(lambda p, x: self.apply(p, {}, x))
        self._jit_recalibrate = None

    # -- forward passes --------------------------------------------------------------------

    def _forward(self, trainable: dict[str, Any], frozen: dict[str, Any], x: jax.Array) -> Any:
        params = _with_head(frozen["params"], trainable["head"])
        sets: dict[str, Any] = {}
        if self.method == "sd_lora" and "alpha" in trainable:
            for k in self.kernels:
                kernel = continual.sd_lora_kernel(
                    frozen["w0"][k], frozen["dirs"][k], trainable["alpha"][k]
                )
                params = _set(params, k, kernel)
        if "shared" in trainable:
            sets["shared"] = trainable["shared"]
        if "specific" in trainable:
            sets["specific"] = trainable["specific"]
        if "b" in trainable:  # inflora: fixed A, trained B
            sets["shared"] = {
                k: ad.replace(factors={"a": frozen["a"][k], "b": trainable["b"][k]})
                for k, ad in frozen["template"].items()
            }
        if "module" in trainable:  # gr_lora: module a beside the shared a, sharing its b
            sets["module"] = {
                k: ad.replace(
                    factors={"a": ad.factors["a"], "b": trainable["shared"][k].factors["b"]}
                )
                for k, ad in trainable["module"].items()
            }
        return self.apply(params, sets, x)

    # -- per-task setup -------------------------------------------------------------------

    def _layer_inputs(self, x: np.ndarray) -> dict[str, jax.Array]:
        n = self.config.method.memory_examples
        _, inputs = self._jit_layer_inputs(self.params, jnp.asarray(x[:n]))
        return inputs

    def setup(self, t: int, key: jax.Array) -> _Task:
        c, m = self.config, self.method
        head = self.params["params"]["head"]
        frozen: dict[str, Any] = {"params": self.params}
        rank = c.adapter.rank
        if m == "saber":
            k_sh, k_sp = jax.random.split(key)
            sh = _lora_set(k_sh, self.params, c, rank // 2)
            sp = _lora_set(k_sp, self.params, c, rank - rank // 2)
            sh = _replace_a(
                sh,
                {
                    k: jnp.where(
                        self.shared_mem[k].size > 0,
                        lj_optim.project_onto(self.shared_mem[k], ad.factors["a"]),
                        ad.factors["a"],
                    )
                    for k, ad in sh.items()
                },
            )
            sp = _replace_a(
                sp,
                {
                    k: lj_optim.project_off(self.shared_mem[k], ad.factors["a"])
                    for k, ad in sp.items()
                },
            )
            trainable = {"shared": sh, "specific": sp, "head": head}
            frozen["shared_mem"] = self.shared_mem
            lam = c.method.saber.lambda_align

            def penalty(tr, fr):
                return lam * sum(
                    continual.alignment_penalty(ad.factors["a"], fr["shared_mem"][k])
                    for k, ad in tr["shared"].items()
                )

            return _Task(trainable, frozen, optimizer(c), penalty)
        lora = _lora_set(key, self.params, c, rank)
        if m in ("seq_lora", "joint"):
            return _Task({"shared": lora, "head": head}, frozen, optimizer(c))
        if m == "o_lora":
            frozen["old_a"] = self.old_a
            lam = c.method.o_lora.lambda_orth

            def penalty(tr, fr):
                return lam * sum(
                    continual.o_lora_penalty(ad.factors["a"], fr["old_a"][k])
                    for k, ad in tr["shared"].items()
                )

            return _Task({"shared": lora, "head": head}, frozen, optimizer(c), penalty)
        if m == "inflora":
            inputs = self._layer_inputs(self.stream.tasks[t]["train"]["x"])
            frozen["a"] = {
                k: continual.inflora_down_projection(inputs[k], self.memory[k], rank=rank)
                for k in self.kernels
            }
            frozen["template"] = lora
            self._inflora = (frozen["a"], lora)
            trainable = {"b": {k: ad.factors["b"] for k, ad in lora.items()}, "head": head}
            return _Task(trainable, frozen, optimizer(c))
        if m == "gpm_lora":
            lora = _replace_a(
                lora,
                {
                    k: lj_optim.project_off(self.memory[k], ad.factors["a"])
                    for k, ad in lora.items()
                },
            )
            memory = {f"shared/{k}/factors/a": self.memory[k] for k in self.kernels}
            tx = optimizer(c, [lj_optim.scale_by_orthogonal_projection(memory)])
            return _Task({"shared": lora, "head": head}, frozen, tx)
        if m == "sd_lora":
            frozen["w0"], frozen["dirs"] = self.w0, self.dirs
            trainable = {"shared": lora, "head": head}
            if t > 0:  # orbax cannot save the empty magnitudes of task 0
                trainable["alpha"] = dict(self.alphas)
            return _Task(trainable, frozen, optimizer(c))
        if m == "gr_lora":
            a_full = {k: ad.factors["a"] for k, ad in lora.items()}
            shared = _replace_a(
                lora, {k: lj_optim.project_off(self.memory[k], a) for k, a in a_full.items()}
            )
            module = {  # the module's own b is unused (it reads the shared b): a fresh buffer
                k: ad.replace(
                    factors={
                        "a": lj_optim.project_onto(self.memory[k], ad.factors["a"]),
                        "b": jnp.zeros_like(ad.factors["b"]),
                    }
                )
                for k, ad in lora.items()
            }
            memory = {f"shared/{k}/factors/a": self.memory[k] for k in self.kernels}
            tx = optimizer(
                c,
                [
                    lj_optim.scale_by_gradient_recycling(
                        memory, recycle_scale=c.method.gr_lora.recycle_scale
                    )
                ],
            )
            task = _Task({"shared": shared, "module": module, "head": head}, frozen, tx)
            g = c.method.gr_lora
            if (g.lambda_local or g.lambda_global) and self.stream.protocol == "cil":
                task.ood = self._ood_loss(t)
            return task
        raise ValueError(f"unknown method {m!r}")

    def _ood_loss(self, t: int) -> Callable[..., jax.Array]:
        g = self.config.method.gr_lora
        stats = self.stats
        own = jnp.asarray(self.stream.task_classes[t])
        others = np.concatenate([self.stream.task_classes[s] for s in range(t)]) if t else None
        mask = np.zeros(self.stream.num_classes, bool)
        mask[self.stream.task_classes[t]] = True
        mask = jnp.asarray(mask)
        num = g.ood_batch
        shape = (num, *self.stream.tasks[t]["train"]["x"].shape[1:])  # features are flattened

        def loss(tr, fr, key, forward):
            k1, k2 = jax.random.split(key)
            total = 0.0
            if g.lambda_local:
                x = continual.synthesize_local(k1, fr["stats"], own, num).reshape(shape)
                total += g.lambda_local * continual.mismatch_loss(forward(tr, fr, x), mask)
            if g.lambda_global and others is not None:
                x = continual.synthesize_global(k2, fr["stats"], jnp.asarray(others), num)
                x = x.reshape(shape)
                total += g.lambda_global * continual.mismatch_loss(forward(tr, fr, x), mask)
            return total

        del stats
        return loss

    # -- consolidation -------------------------------------------------------------------

    def consolidate(self, t: int, trained: dict[str, Any]) -> None:
        """Folds the task just trained into the continual state (deterministic)."""
        c, m = self.config, self.method
        trained = jax.device_get(trained)
        params = _with_head(self.params, trained["head"])
        deltas = {}
        if "shared" in trained:
            for k, ad in trained["shared"].items():
                deltas[k] = adapters.delta(ad, self.w0[k].shape)
        if m == "inflora":
            a, template = self._inflora
            for k, ad in template.items():
                fixed = ad.replace(factors={"a": a[k], "b": trained["b"][k]})
                deltas[k] = adapters.delta(fixed, self.w0[k].shape)
        raw = dict(deltas)  # the task's own update ΔW_t (SABER: shared + specific halves)
        if m == "saber":
            for k in self.kernels:
                raw[k] = deltas[k] + adapters.delta(trained["specific"][k], self.w0[k].shape)
        self.task_updates.append(
            np.concatenate([np.ravel(np.asarray(raw[k], np.float32)) for k in self.kernels])
        )
        if m == "saber":
            sab = c.method.saber
            before = self._layer_inputs(self.stream.tasks[t]["train"]["x"])  # inputs ΔW_t saw
            for k in self.kernels:
                dw = raw[k]
                s, d = continual.decompose_update(dw, self.shared_mem[k], self.spec_mem[k])
                x = before[k]
                new_cov = x.T @ x / x.shape[0]
                s = continual.balance_by_input_energy(
                    s, self.old_cov[k], new_cov, strength=sab.energy_strength
                )
                self.old_cov[k] = self.old_cov[k] + new_cov
                self.saber_parts[k][0].append(s)
                self.saber_parts[k][1].append(d)
                total, lam, beta = continual.recompose(
                    jnp.stack(self.saber_parts[k][0]),
                    jnp.stack(self.saber_parts[k][1]),
                    gamma=c.method.saber.gamma,
                    min_weight=c.method.saber.min_weight,
                    shared_mode=c.method.saber.shared_mode,
                )
                self.saber_weights[k] = {"lambda": np.asarray(lam), "beta": np.asarray(beta)}
                params = _set(params, k, self.w0[k] + total)
                self.spec_mem[k] = lj_optim.extend_subspace_memory(
                    self.spec_mem[k], d.T, threshold=c.method.saber.specific_threshold
                )
        elif m == "sd_lora":
            for k in self.kernels:
                direction, norm = continual.unit_direction(deltas[k])
                self.dirs[k] = jnp.concatenate([self.dirs[k], direction[None]])
                old = trained["alpha"][k] if "alpha" in trained else self.alphas[k]
                self.alphas[k] = jnp.concatenate([jnp.asarray(old), norm[None]])
                params = _set(
                    params, k, continual.sd_lora_kernel(self.w0[k], self.dirs[k], self.alphas[k])
                )
        else:
            for k in self.kernels:
                params = _set(params, k, _get(params, k) + deltas[k])
        if m == "o_lora":
            for k, ad in trained["shared"].items():
                self.old_a[k] = jnp.concatenate([self.old_a[k], ad.factors["a"][None]])
        if m == "gr_lora":
            self.modules.append(
                {
                    k: ad.replace(
                        factors={"a": ad.factors["a"], "b": trained["shared"][k].factors["b"]}
                    )
                    for k, ad in trained["module"].items()
                }
            )
        self.params = params
        if m == "saber" and c.method.saber.recalibrate_steps:
            self.params = _with_head(self.params, self._recalibrate_head(t))
        if m in _MEMORY_METHODS or m == "saber":
            inputs = self._layer_inputs(self.stream.tasks[t]["train"]["x"])
            for k in self.kernels:
                if m == "saber":
                    self.shared_mem[k] = lj_optim.extend_subspace_memory(
                        self.shared_mem[k], inputs[k], threshold=c.method.saber.shared_threshold
                    )
                else:
                    self.memory[k] = lj_optim.extend_subspace_memory(
                        self.memory[k], inputs[k], threshold=c.method.memory_threshold
                    )
            mem = self.shared_mem if m == "saber" else self.memory
            self.memory_fill.append(
                float(np.mean([int(mem[k].size) / mem[k].basis.shape[0] for k in self.kernels]))
            )
        if m == "gr_lora":
            tr = self.stream.tasks[t]["train"]
            self.stats = continual.class_statistics(
                tr["x"], tr["y"], self.stream.num_classes, previous=self.stats
            )

    def _recalibrate_head(self, t: int) -> Any:
        """Refits the head on task ``t`` over the recomposed (frozen) features; deterministic."""
        c = self.config
        arrays = _task_arrays(self.stream, [t])
        params = self.params
        tx = optax.adam(c.optim.learning_rate)
        head = jax.tree.map(jnp.asarray, params["params"]["head"])
        opt_state = tx.init(head)
        if self._jit_recalibrate is None:

            @jax.jit
            def step(params, head, opt_state, x, y, mask):
                def loss_fn(h):
                    return _masked_ce(self.model.apply(_with_head(params, h), x), y, mask)

                grads = jax.grad(loss_fn)(head)
                updates, opt_state = tx.update(grads, opt_state, head)
                return optax.apply_updates(head, updates), opt_state

            self._jit_recalibrate = step
        rng = np.random.default_rng([c.seeds[0], t, 17])
        n, bs = len(arrays["y"]), min(c.data.batch_size, len(arrays["y"]))
        for _ in range(c.method.saber.recalibrate_steps):
            idx = rng.choice(n, bs, replace=False)
            head, opt_state = self._jit_recalibrate(
                params, head, opt_state, arrays["x"][idx], arrays["y"][idx], arrays["mask"][idx]
            )
        return jax.device_get(head)

    # -- evaluation ----------------------------------------------------------------------

    def evaluate(self, t: int) -> tuple[list[float], float]:
        """Accuracy on the test sets of tasks ``0..t`` (and GR-LoRA's selection accuracy)."""
        s = self.stream
        seen = np.zeros(s.num_classes, bool)
        for j in range(t + 1):
            seen[s.task_classes[j]] = True
        accs, selected_ok, total = [], 0, 0
        bs = self.config.eval.batch_size
        plain = self._jit_plain
        if self.method == "gr_lora":
            masks = np.zeros((t + 1, s.num_classes), bool)
            for j in range(t + 1):
                masks[j, s.task_classes[j]] = True
            modules = self.modules[: t + 1]

            @jax.jit
            def module_logits(p, mods, x):
                return jnp.stack([self.apply(p, {"module": md}, x) for md in mods])

        for j in range(t + 1):
            test = s.tasks[j]["test"]
            mask = np.zeros(s.num_classes, bool)
            mask[s.task_classes[j]] = True
            eval_mask = mask if s.protocol == "til" else seen
            correct = 0
            for i in range(0, len(test["y"]), bs):
                x, y = jnp.asarray(test["x"][i : i + bs]), test["y"][i : i + bs]
                if self.method == "gr_lora":
                    all_logits = module_logits(self.params, modules, x)
                    if s.protocol == "til":
                        logits = all_logits[j]
                    else:
                        weights, _ = continual.select_module(all_logits, masks)
                        pick = np.asarray(jnp.argmax(weights, -1))
                        selected_ok += int(np.sum(pick == j))
                        total += len(pick)
                        logits = np.asarray(all_logits)[pick, np.arange(len(pick))]
                else:
                    logits = plain(self.params, x)
                pred = np.argmax(np.where(eval_mask, np.asarray(logits), -np.inf), -1)
                correct += int(np.sum(pred == y))
            accs.append(correct / len(test["y"]))
        return accs, (selected_ok / total if total else math.nan)


def _train_task(
    learner: Learner,
    t: int,
    task: _Task,
    arrays: dict[str, np.ndarray],
    workdir: str,
    seed: int,
    num_steps: int,
    description: str,
) -> dict[str, Any]:
    c = learner.config
    tx = task.tx
    state = {"trainable": task.trainable, "opt_state": tx.init(task.trainable)}
    # fit donates the state: copy it so the learner's arrays (memories, heads) stay alive
    state = {**jax.tree.map(jnp.copy, state), "step": 0}
    if learner.method == "gr_lora" and learner.stats is not None:
        task.frozen["stats"] = continual.ClassStatistics(*(jnp.asarray(a) for a in learner.stats))
    forward = learner._forward

    def step(state, frozen, batch, key):
        def loss_fn(tr):
            logits = forward(tr, frozen, batch["x"])
            ce = _masked_ce(logits, batch["y"], batch["mask"])
            loss = ce
            if task.penalty is not None:
                loss = loss + task.penalty(tr, frozen)
            if task.ood is not None and "stats" in frozen:
                loss = loss + task.ood(tr, frozen, key, forward)
            return loss, ce

        (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["trainable"])
        return {
            **state,
            "trainable": optax.apply_updates(state["trainable"], updates),
            "opt_state": opt_state,
        }, {"loss": loss, "ce": ce}

    result = common.fit(
        state,
        task.frozen,
        step,
        data.BatchIterator(arrays, batch_size=c.data.batch_size, seed=seed * 1000 + t),
        key=jax.random.fold_in(jax.random.key(seed), 7919 + t),
        num_steps=num_steps,
        workdir=workdir,
        log_every=c.log.every,
        ckpt_every=num_steps,
        max_to_keep=c.ckpt.max_to_keep,
        progress=c.log.progress,
        description=description,
    )
    if learner.method == "gr_lora":
        fractions = [
            float(s.recycled_fraction)
            for s in jax.tree.leaves(
                result.state["opt_state"],
                is_leaf=lambda x: isinstance(x, lj_optim.GradientRecyclingState),
            )
            if isinstance(s, lj_optim.GradientRecyclingState)
        ]
        learner.recycled_fraction.append(fractions[0] if fractions else math.nan)
    return {"state": result.state, "interrupted": result.interrupted}


def _task_arrays(stream: Stream, tasks: list[int]) -> dict[str, np.ndarray]:
    xs, ys, masks = [], [], []
    for t in tasks:
        tr = stream.tasks[t]["train"]
        mask = np.zeros(stream.num_classes, bool)
        if stream.protocol == "til" or len(tasks) == 1:
            mask[stream.task_classes[t]] = True
        else:  # joint class-incremental: all classes
            mask[:] = True
        xs.append(tr["x"])
        ys.append(tr["y"])
        masks.append(np.repeat(mask[None], len(tr["y"]), 0))
    return {"x": np.concatenate(xs), "y": np.concatenate(ys), "mask": np.concatenate(masks)}


def run_method(
    config: Any, method: str, seed: int, stream: Stream, model: Any, variables: Any, workdir: str
) -> dict[str, Any]:
    """Runs one method over the stream; returns its accuracy matrix and diagnostics."""
    num_tasks = len(stream.tasks)
    learner = Learner(config, method, model, variables, stream)
    r = np.full((num_tasks, num_tasks), np.nan)
    selection = []
    steps = config.schedule.steps_per_task
    if method == "joint":
        task = learner.setup(0, jax.random.fold_in(jax.random.key(seed), 0))
        out = _train_task(
            learner,
            0,
            task,
            _task_arrays(stream, list(range(num_tasks))),
            os.path.join(workdir, "task_0"),
            seed,
            steps * num_tasks,
            f"{method} seed {seed} all tasks",
        )
        if out["interrupted"]:
            return {"interrupted": True}
        learner.consolidate(0, out["state"]["trainable"])
        accs, _ = learner.evaluate(num_tasks - 1)
        r[-1] = accs
        return {"R": r, "interrupted": False}
    for t in range(num_tasks):
        key = jax.random.fold_in(jax.random.key(seed), t)
        task = learner.setup(t, key)
        out = _train_task(
            learner,
            t,
            task,
            _task_arrays(stream, [t]),
            os.path.join(workdir, f"task_{t}"),
            seed,
            steps,
            f"{method} seed {seed} task {t + 1}/{num_tasks}",
        )
        if out["interrupted"]:
            return {"interrupted": True}
        learner.consolidate(t, out["state"]["trainable"])
        accs, sel = learner.evaluate(t)
        r[t, : t + 1] = accs
        selection.append(sel)
    return {
        "R": r,
        "interrupted": False,
        "selection_accuracy": selection,
        "memory_fill": learner.memory_fill,
        "recycled_fraction": learner.recycled_fraction,
        "update_cosine": _cosines(learner.task_updates),
        "saber_weights": {
            k: {n: v.tolist() for n, v in w.items()} for k, w in learner.saber_weights.items()
        },
    }


def _mean_offdiagonal(cosine: list[list[float]]) -> float:
    c = np.abs(np.asarray(cosine, np.float64))
    n = len(c)
    return float((c.sum() - np.trace(c)) / (n * (n - 1))) if n > 1 else math.nan


def _cosines(updates: list[np.ndarray]) -> list[list[float]]:
    """``cos(ΔW_i, ΔW_j)`` over all adapted kernels (specs §1 (4)'s diagnostic), ``(T, T)``."""
    u = np.stack(updates).astype(np.float64)
    u /= np.maximum(np.linalg.norm(u, axis=1, keepdims=True), 1e-30)
    return (u @ u.T).tolist()


# ----------------------------------------------------------------------------------------------
# The run.


def _summary(method: str, r: np.ndarray) -> dict[str, float]:
    if method == "joint":
        return {
            "final_acc": float(np.mean(r[-1])),
            "avg_inc_acc": math.nan,
            "forgetting": math.nan,
            "bwt": math.nan,
            "plasticity": math.nan,
        }
    return continual.summarize(r)


def _mean_sd(values: list[float]) -> str:
    v = np.asarray(values, np.float64)
    if np.all(np.isnan(v)):
        return "–"
    if len(v) == 1:
        return f"{v[0]:.3f}"
    return f"{np.nanmean(v):.3f} ± {np.nanstd(v, ddof=1):.3f}"


def run(config: Any, workdir: str) -> dict[str, Any]:
    """Runs every method of ``config.methods`` for every seed; writes and prints the table.

    Returns:
      ``{"benchmark", "table": {method: {metric: mean}}, "interrupted"}``.
    """
    check_config(config)
    bench = config.data.benchmark
    records: dict[str, list[dict[str, Any]]] = {m: [] for m in config.methods}
    for seed in config.seeds:
        stream = load_stream(config, seed)
        model, variables = build_backbone(
            config, stream, seed, os.path.join(workdir, f"seed_{seed}")
        )
        for method in config.methods:
            out = run_method(
                config,
                method,
                seed,
                stream,
                model,
                variables,
                os.path.join(workdir, method, f"seed_{seed}"),
            )
            if out["interrupted"]:
                return {"benchmark": bench, "interrupted": True}
            out["summary"] = _summary(method, out["R"])
            records[method].append(out)
            logging.info("%s seed %d: %s", method, seed, out["summary"])
    return _write_outputs(config, workdir, records)


_COLUMNS = ("final_acc", "avg_inc_acc", "forgetting", "bwt", "plasticity")


def _write_outputs(config: Any, workdir: str, records: dict[str, list[dict]]) -> dict[str, Any]:
    bench = config.data.benchmark
    rows, table = [], {}
    for method, outs in records.items():
        row = {"method": method}
        table[method] = {}
        for col in _COLUMNS:
            vals = [o["summary"][col] for o in outs]
            row[col] = _mean_sd(vals)
            table[method][col] = float(np.nanmean(vals)) if not np.all(np.isnan(vals)) else math.nan
        vals = [_mean_offdiagonal(o["update_cosine"]) for o in outs if "update_cosine" in o]
        if vals:
            row["update_cos"] = _mean_sd(vals)
            table[method]["update_cos"] = float(np.nanmean(vals))
        if method == "gr_lora" and PROTOCOLS[bench] == "cil":
            vals = [o["selection_accuracy"][-1] for o in outs]
            row["selection_acc"] = _mean_sd(vals)
            table[method]["selection_acc"] = float(np.mean(vals))
        rows.append(row)
    seeds = ", ".join(str(s) for s in config.seeds)
    notes = (
        f"Benchmark `{bench}` ({PROTOCOLS[bench]}), {config.data.num_tasks} tasks, seeds ({seeds}), "
        f"LoRA rank {config.adapter.rank}, {config.schedule.steps_per_task} steps per task. "
        "final_acc: mean accuracy on all tasks after the last; avg_inc_acc: mean over steps of the "
        "accuracy on the tasks seen so far; forgetting/bwt: from the accuracy matrix; plasticity: "
        "mean accuracy on each task right after learning it; update_cos: mean |cos| between "
        "different tasks' updates ΔW_t (all adapted kernels). Mean ± sd over seeds."
    )
    columns = ["method", *_COLUMNS] + [
        c for c in ("update_cos", "selection_acc") if any(c in r for r in rows)
    ]
    text = common.write_results_md(
        workdir, rows, title=f"Continual learning on {bench}", columns=columns, notes=notes
    )
    matrices = {
        m: [
            {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in o.items()}
            for o in outs
        ]
        for m, outs in records.items()
    }
    common.write_json(os.path.join(workdir, "accuracy_matrices.json"), matrices)
    _plots(workdir, records)
    print(text)
    return {"benchmark": bench, "table": table, "interrupted": False}


def _plots(workdir: str, records: dict[str, list[dict]]) -> None:
    if jax.process_index() != 0:
        return
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    for method, outs in records.items():
        r = np.mean(np.stack([o["R"] for o in outs]), axis=0)  # NaN above the diagonal
        fig, ax = plt.subplots(figsize=(4, 3.5), dpi=100)
        im = ax.imshow(r, vmin=0, vmax=1, cmap="viridis")
        ax.set_xlabel("evaluated task j")
        ax.set_ylabel("after task t")
        ax.set_title(f"{method}: accuracy R[t, j]")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(os.path.join(workdir, f"acc_matrix_{method}.png"))
        plt.close(fig)
    curves = {}
    for method, outs in records.items():
        if method == "joint":
            continue
        diag = np.mean([np.diag(o["R"]) for o in outs], axis=0)
        curves[method] = (list(range(1, len(diag) + 1)), diag.tolist())
    common.plot_curves(
        os.path.join(workdir, "plasticity.png"),
        curves,
        title="new-task accuracy right after learning it",
        xlabel="task",
        ylabel="accuracy",
    )
    fills = {
        m: (
            list(range(1, len(outs[0]["memory_fill"]) + 1)),
            np.mean([o["memory_fill"] for o in outs], axis=0).tolist(),
        )
        for m, outs in records.items()
        if outs and outs[0].get("memory_fill")
    }
    if fills:
        common.plot_curves(
            os.path.join(workdir, "memory_fill.png"),
            fills,
            title="subspace memory: fraction of input dims used",
            xlabel="task",
            ylabel="k / n (mean over kernels)",
        )
