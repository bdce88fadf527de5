"""The continual methods of the experiment (``continual.py``), built from the config: a lookup
of keyword arguments, since the methods live in the library (:mod:`lowrank_jax.continual`); and
the experiment's jitted programs on abstract inputs (:func:`steps`, for lowering and costing).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.common import lowering
from experiments.common.continual_backbones import make_model, pretrain_setup
from experiments.common.continual_setup import stream_shapes
from lowrank_jax import continual
from lowrank_jax.models.bert import split_encoder
from lowrank_jax.models.bert_prefix import prefix_encoder

METHODS = ("saber", "gr_lora", "seq_lora", "o_lora", "inflora", "gpm_lora", "sd_lora", "joint")
HEADS = ("masked", "aligned", "prototype")  # config.head: the method as is, or with_head's


def make_method(
    config: Any, name: str, apply_fn: Any, protocol: str, seed: int = 0
) -> continual.ContinualMethod:
    """The :class:`~lowrank_jax.continual.ContinualMethod` ``name`` with the config's settings,
    wrapped by :func:`~lowrank_jax.continual.with_head` with the head value that ``config.head``
    names (``aligned``: :class:`~lowrank_jax.continual.AlignedHead`, ``prototype``:
    :class:`~lowrank_jax.continual.PrototypeHead`, knobs from ``config.method.heads``; ``masked``:
    unwrapped; ``seed``: the alignment's sampling)."""
    c, m = config, config.method
    kw = dict(
        targets=tuple(c.adapter.targets),
        rank=c.adapter.rank,
        alpha=c.adapter.alpha,
        learning_rate=c.optim.learning_rate,
        grad_clip=c.optim.grad_clip,
    )
    memory = dict(memory_threshold=m.memory_threshold, memory_examples=m.memory_examples)
    s, g = m.saber, m.gr_lora
    cil = protocol == "cil"  # task-incremental: the task id picks GR-LoRA's module, no mismatch
    factories = {
        "seq_lora": lambda: continual.sequential_lora(apply_fn, **kw),
        "joint": lambda: continual.joint(apply_fn, **kw),
        "o_lora": lambda: continual.o_lora(apply_fn, **kw, lambda_orth=m.o_lora.lambda_orth),
        "inflora": lambda: continual.inflora(apply_fn, **kw, **memory),
        "gpm_lora": lambda: continual.gpm_lora(apply_fn, **kw, **memory),
        "sd_lora": lambda: continual.sd_lora(apply_fn, **kw),
        "saber": lambda: continual.saber(
            apply_fn,
            **kw,
            shared_threshold=s.shared_threshold,
            specific_threshold=s.specific_threshold,
            lambda_align=s.lambda_align,
            gamma=s.gamma,
            min_weight=s.min_weight,
            shared_mode=s.shared_mode,
            energy_strength=s.energy_strength,
            recalibrate_steps=s.recalibrate_steps,
            recalibrate_batch=c.data.batch_size,
            # the published tables refit every seed's heads in the first seed's batch order
            recalibrate_seed=c.seeds[0],
            memory_examples=m.memory_examples,
        ),
        "gr_lora": lambda: continual.gr_lora(
            apply_fn,
            **kw,
            **memory,
            recycle_scale=g.recycle_scale,
            lambda_local=g.lambda_local if cil else 0.0,
            lambda_global=g.lambda_global if cil else 0.0,
            ood_batch=g.ood_batch,
        ),
    }
    method, h = factories[name](), m.heads
    if c.head == "masked":  # the head trained by masked cross-entropy: the method as it is
        return method
    head = (
        continual.AlignedHead(
            steps=h.align_steps,
            learning_rate=h.align_learning_rate,
            num_per_class=h.align_per_class,
        )
        if c.head == "aligned"
        else continual.PrototypeHead(metric=h.metric, ridge=h.ridge)
    )
    return continual.with_head(
        method,
        head=head,
        seed=seed,
        shrinkage=h.shrinkage,
        drift=h.drift,
        drift_bandwidth=h.drift_bandwidth,
    )


def program_steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The jitted programs of a run on abstract inputs (no data, no weights read): the cached
    MiniLM layers or the base session's step, and each method's first-task ``fit`` step.

    (A method's ``predict`` and ``end_task`` jit inside the library on the state a task leaves,
    so they are not among them.)
    """
    mesh = common.make_mesh() if mesh is None else mesh
    shapes, b = stream_shapes(config), config.data.batch_size
    key, f32, spec = jax.random.key(0), jnp.float32, jax.ShapeDtypeStruct
    out = []
    if config.data.benchmark == "shakespeare_plays":
        bert_config, encoder = lowering.abstract_minilm()
        prefix = split_encoder(bert_config, encoder, config.model.first_layer)
        ids = spec((64, config.data.seq_len), jnp.int32)  # chunks of 64
        out.append(common.Step("prefix encoder", prefix_encoder(prefix[0]), (prefix[1], ids)))
    if shapes["base"] is not None:
        x_shape, classes = shapes["base"]
        state, step = common.eval_shape_with_static(
            lambda k: pretrain_setup(config, make_model(config, classes), x_shape, k), key
        )
        batch = {"x": spec((b, *x_shape), f32), "y": spec((b,), jnp.int32)}
        out.append(common.fit_step(step, state, None, batch, mesh=mesh, name="base session"))
    model = make_model(config, shapes["num_classes"])
    variables = jax.eval_shape(model.init, key, jnp.zeros((1, *shapes["x"])))
    batch = {"x": spec((b, *shapes["x"]), f32), "y": spec((b,), jnp.int32)}
    batch["mask"] = spec((b, shapes["num_classes"]), jnp.bool_)
    for name in config.methods:
        method = make_method(config, name, model.apply, shapes["protocol"], config.seeds[0])
        x = np.zeros((b, *shapes["x"]), np.float32)  # a stand-in first task (never read)
        task = continual.Task(0, shapes["task_classes"], x, np.zeros(b, np.int32), shapes["num_classes"])  # fmt: skip

        def first_task(variables, method=method, task=task):
            trainable, frozen, tx = method.begin_task(method.init(variables), key, task)
            return (trainable, frozen, tx.init(trainable)), tx

        (trainable, frozen, opt_state), tx = common.eval_shape_with_static(first_task, variables)
        state = {"trainable": trainable, "opt_state": opt_state, "step": 0}
        out.append(common.fit_step(continual.make_train_step(method, tx), state, frozen, batch, mesh=mesh, name=name))  # fmt: skip
    return out
