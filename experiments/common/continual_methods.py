"""The continual methods of the experiment (``continual.py``), built from the config: a lookup
of keyword arguments, since the methods live in the library (:mod:`lowrank_jax.continual`).
"""

from __future__ import annotations

from typing import Any

from lowrank_jax import continual

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
