"""The parts of ``experiments/llm_sft.py`` that act on a decoder and its adapters: the adapter
rules of ``adapter.method``, the initial adapters of ``adapter.init``, the frozen base, the packed
forward, the optimizer, the train step ``fit`` runs, the evaluation on packed rows, and the export
(PEFT ``adapter/``, a merged checkpoint with the tokenizer files copied)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common
from lowrank_jax import adapters, data, models, optim
from lowrank_jax.data import text
from lowrank_jax.optim.sbvi import sbvi_mean

PEFT_METHODS = ("lora", "dora")  # the kinds a PEFT adapter_config.json describes

KERNELS = r".*_proj/kernel"  # what a quantised base stores in low precision
# What a merged checkpoint needs besides the weights, copied from the input checkpoint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def adapter_rules(config: Any, init: str = "kaiming") -> list[tuple[str, Any]]:
    """``adapter.method``'s spec on every target, stacked on the layer axis (``(L, n, m)``)."""
    a = config.adapter
    layout = {"in_ndim": 1, "out_ndim": 1}
    if a.method == "frameft":  # P10: coefficients on a fixed frame of the kernel's shape
        spec = adapters.frameft(a.frame_coeff, scale=a.frame_scale, **layout)
    elif a.method == "sbvi":  # P8: U diag(σ) Vᵀ, σ evolved by scale_by_sbvi
        spec = adapters.spectral(a.rank, **layout)
    elif a.method == "dora":
        spec = adapters.dora(a.rank, alpha=a.alpha, **layout)
    else:
        spec = adapters.lora(a.rank, alpha=a.alpha, init=init, **layout)
    return [(t, spec) for t in a.targets]


def packed_loss(forward: Any, batch: Any) -> jax.Array:
    """``loss_fn(forward, batch)`` of the data-aware initialisers: mean next-token loss."""
    logits = forward(
        batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
    )
    total, count = text.next_token_loss(logits, batch["tokens"], batch["loss_mask"])
    return total / jnp.maximum(count, 1.0)


def initial_adapters(
    config: Any, model: models.DecoderLM, variables: Any, packed: dict[str, np.ndarray]
) -> tuple[Any, Any]:
    """``(adapters, base)`` before training, by ``adapter.init``: ``kaiming`` (``B = 0``, the base
    unchanged), ``pissa`` (the top singular triples, ``adapters.unfold`` takes them out of the
    base) or ``lora_da`` (P6: ``adapters.lora_da`` from the per-example gradients and K-FAC
    statistics of the first ``adapter.init_rows`` packed training rows; the base unchanged)."""
    a, key = config.adapter, jax.random.key(config.seed)
    if a.init == "lora_da":
        rows = min(a.init_rows, len(packed["tokens"]))
        batch = {
            k: jnp.asarray(packed[k][:rows])
            for k in ("tokens", "segment_ids", "positions", "loss_mask")
        }
        ad = adapters.lora_da(
            key,
            variables,
            adapter_rules(config),
            batch,
            apply_fn=model.apply,
            loss_fn=packed_loss,
            num_train=len(packed["tokens"]),
            chunk_size=4,
        )
        return ad, variables
    ad = adapters.init(key, variables, adapter_rules(config, init=a.init))
    return ad, adapters.unfold(variables, ad) if a.init == "pissa" else variables


def sbvi_state(opt_state: Any) -> optim.SBVIState:
    """The ``SBVIState`` inside the run's optimizer state (chained after gradient clipping)."""
    is_state = lambda x: isinstance(x, optim.SBVIState)  # noqa: E731
    (found,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
    return found


def evaluated(config: Any, state: dict[str, Any]) -> Any:
    """The adapters to evaluate and export: SBVI's at the posterior mean (its parameters hold a
    sample of ``q(σ)``), the others as trained."""
    if config.adapter.method != "sbvi":
        return state["adapters"]
    return sbvi_mean(state["adapters"], sbvi_state(state["opt_state"]))


def frozen_base(config: Any, variables: Any) -> Any:
    """The checkpoint's variables with the projection kernels stored as ``adapter.base``."""
    return adapters.low_precision_base(
        variables,
        config.adapter.base,
        patterns=(KERNELS,),
        block_size=config.adapter.nf4_block_size,
    )


def make_forward(model: models.DecoderLM) -> Any:
    """``forward(adapters, frozen, batch) -> logits`` on a packed batch, applied factorised."""
    adapted = adapters.adapt(model.apply)

    def forward(lora, frozen, batch):
        return adapted(
            frozen,
            lora,
            batch["tokens"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
        )

    return forward


def optimizer(config: Any) -> optax.GradientTransformation:
    s = config.schedule
    lr = optax.warmup_cosine_decay_schedule(
        0.0, config.optim.learning_rate, s.warmup_steps, s.num_steps, end_value=0.0
    )
    if config.adapter.method == "sbvi":
        a = config.adapter
        tx = optim.scale_by_sbvi(
            learning_rate=config.optim.learning_rate,
            friction=a.sbvi_friction,
            temperature=a.sbvi_temperature,
            anneal_steps=max(1, int(0.8 * s.num_steps)),
            prune_start=max(1, s.num_steps // 4),
            seed=config.seed,
        )
    else:
        tx = optax.adamw(lr, weight_decay=config.optim.weight_decay)
    if config.optim.grad_clip:
        tx = optax.chain(optax.clip_by_global_norm(config.optim.grad_clip), tx)
    return tx


def logits_and_counts(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(logits, counts)`` of a forward that returns logits or ``(logits, {name: counts})``
    (the FP8 forward of :mod:`~experiments.common.llm_fp8`: per-layer overflow counts)."""
    return out if isinstance(out, tuple) else (out, {})


def make_step(forward: Any, tx: optax.GradientTransformation) -> Any:
    """``step(state, frozen, batch, rng)`` for ``fit``: the mean loss over the batch's targets
    (and the total of each count the forward reports)."""

    def step(state, frozen, batch, rng):
        del rng

        def loss_fn(lora):
            logits, counts = logits_and_counts(forward(lora, frozen, batch))
            total, count = text.next_token_loss(logits, batch["tokens"], batch["loss_mask"])
            return total / jnp.maximum(count, 1.0), (count, counts)

        (loss, (count, counts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["adapters"]
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["adapters"])
        new = optax.apply_updates(state["adapters"], updates)
        totals = {k: jnp.sum(v) for k, v in counts.items()}
        return {**state, "adapters": new, "opt_state": opt_state}, {
            "loss": loss,
            "target_tokens": count,
            **totals,
        }

    return step


def make_evaluate(forward: Any, mesh: Any, *, batch_size: int) -> Any:
    """``evaluate(adapters, frozen, packed) -> {"valid/loss", "valid/ppl"}``: the mean next-token
    loss over every target of the packed validation rows, and its perplexity; per count ``name``
    the forward reports ((L,) per layer), ``valid/<name>`` and ``valid/<name>_layer<i>``, summed
    over the rows (padding rows get no segment, so they attend to nothing and count nothing)."""

    @jax.jit
    def sums(lora, frozen, batch, weight):
        batch = {**batch, "segment_ids": batch["segment_ids"] * (weight[:, None] > 0)}
        logits, counts = logits_and_counts(forward(lora, frozen, batch))
        mask = batch["loss_mask"] * weight[:, None]
        return (*text.next_token_loss(logits, batch["tokens"], mask), counts)

    def evaluate(lora, frozen, packed):
        total = count = 0.0
        totals = {}
        rows = {**packed, "y": np.zeros(len(packed["tokens"]))}
        for chunk, weight in common.padded_batches(rows, batch_size):
            del chunk["y"]
            t, n, counts = sums(lora, frozen, *common.shard_batch(mesh, (chunk, weight)))
            total, count = total + float(t), count + float(n)
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + np.asarray(v, np.int64)
        loss = total / max(count, 1.0)
        out = {"valid/loss": loss, "valid/ppl": data.perplexity(loss)}
        for k, v in totals.items():
            out[f"valid/{k}"] = int(v.sum())
            out.update({f"valid/{k}_layer{i}": int(c) for i, c in enumerate(v)})
        return out

    return evaluate


# ----------------------------------------------------------------------------------------------
# Outputs.


def export(
    config: Any, workdir: str, checkpoint: str, mc: Any, variables: Any, lora: Any
) -> dict[str, str]:
    """Writes ``<workdir>/adapter`` (PEFT; LoRA and DoRA only) and, with ``export.merged``,
    ``<workdir>/merged`` (``variables``: the base the adapters were trained on)."""
    out = {}
    if config.adapter.method in PEFT_METHODS:
        out["adapter_dir"] = os.path.join(workdir, "adapter")
    if config.export.merged:
        out["merged_dir"] = os.path.join(workdir, "merged")
    if jax.process_index() != 0:  # (every process holds the replicated adapters)
        return out
    if "adapter_dir" in out:
        adapters.save_peft(
            out["adapter_dir"],
            lora,
            module_name=models.decoder_module_name,
            base_model=os.path.abspath(checkpoint),
            task_type="CAUSAL_LM",
        )
    if config.export.merged:
        save_merged(config, out["merged_dir"], checkpoint, mc, adapters.fold(variables, lora))
    return out


def save_merged(config: Any, out_dir: str, checkpoint: str, mc: Any, variables: Any) -> None:
    """``models.save_hf_decoder`` of ``variables`` (stored as ``export.merged_dtype``) with the
    input checkpoint's tokenizer files copied beside."""
    models.save_hf_decoder(out_dir, mc, variables, dtype=config.export.merged_dtype or None)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(checkpoint, name)):
            shutil.copy2(os.path.join(checkpoint, name), out_dir)
