"""P14's geometry-aware FP8 attention scales in ``experiments/llm_sft.py`` (``fp8.enabled``).

Every step computes, from the adapted ``W_Q``, ``W_K`` (the adapters of ``q_proj``/``k_proj``
folded into the frozen base), per layer and query head the scale of
:func:`lowrank_jax.models.decoder_fp8.decoder_attention_scales` (``fp8.bound``: ``rank_aware``,
P14's ``α(δ)`` on the RoPE-safe bound ``‖W_Q,h‖₂‖W_K,g‖₂``; ``rank_agnostic``; ``worst_case``,
``α = 1``, no overflow by construction), and the decoder casts its attention logits to simulated
FP8 E4M3 at those scales (training and evaluation). The overflow counts (attended logits with
``|S·s| > 448``) are logged per step (``fp8_overflow``) and per evaluation (``valid/fp8_overflow``
and per layer ``valid/fp8_overflow_layer<i>``) next to those of a naive scale evaluated on the
same rows (``valid/naive_fp8_overflow``...): the per-(layer, head) ``amax`` scale ``448/amax``
calibrated once on the first ``data.batch_size`` packed training rows with the initial adapters
(static current scaling, ``fp8.delayed.current_scale``).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.common import llm_sft_steps
from lowrank_jax import adapters, fp8
from lowrank_jax.fp8.delayed import current_scale
from lowrank_jax.models import decoder_fp8

BOUNDS = ("rank_aware", "rank_agnostic", "worst_case")  # fp8.bound
_QK = re.compile(r".*(q|k)_proj/kernel")


def check_config(config: Any) -> None:
    """Validates ``config.fp8`` (raises ``common.ConfigError``)."""
    common.check_choice(config, "fp8.bound", BOUNDS)
    common.check_fraction(config, "fp8.delta", allow_zero=False)
    common.check_positive(config, "fp8.calibration")
    if config.fp8.enabled and config.continual.method:
        raise common.ConfigError(
            "config.fp8.enabled is for one training source, not with continual.method"
        )


def scale_rule(config: Any) -> fp8.ScaleRule | None:
    """The config's ``ScaleRule`` (None for ``worst_case``: ``α = 1``)."""
    f = config.fp8
    if f.bound == "worst_case":
        return None
    return fp8.ScaleRule(
        seq_len=config.data.max_length,
        delta=f.delta,
        rank_aware=f.bound == "rank_aware",
        fmt=decoder_fp8.FP8_FORMAT,
        calibration=f.calibration,
    )


def geometry_scales(config: Any, model: Any, lora: Any, frozen: Any) -> jax.Array:
    """(L, H) scales from the adapted query/key kernels (no gradient flows through them)."""
    qk = {p: a for p, a in lora.items() if _QK.fullmatch(p)}
    folded = adapters.quant.dequantize_base(adapters.fold(frozen, qk))
    scales = decoder_fp8.decoder_attention_scales(model.config, folded, scale_rule(config))
    if scale_rule(config) is None:
        scales = scales * config.fp8.calibration
    return jax.lax.stop_gradient(scales)


def _forward(model: Any, scales_fn: Any) -> Any:
    """``forward(adapters, frozen, batch) -> (logits, {"fp8_overflow": (L,) counts})``."""
    adapted = adapters.adapt(model.apply)

    def forward(lora, frozen, batch):
        logits, state = adapted(
            frozen,
            lora,
            batch["tokens"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
            fp8_scales=scales_fn(lora, frozen),
            mutable=["intermediates"],
        )
        return logits, {"fp8_overflow": decoder_fp8.overflow_counts(state).sum(axis=-1)}

    return forward


def make_forward(config: Any, model: Any) -> Any:
    """The run's forward with the geometry-aware scales of the current adapters."""
    return _forward(model, lambda lora, frozen: geometry_scales(config, model, lora, frozen))


def naive_scales(model: Any, lora: Any, frozen: Any, batch: dict[str, np.ndarray]) -> jax.Array:
    """(L, H) ``448/amax`` of the attended logits of ``batch`` (the naive comparison)."""
    adapted = adapters.adapt(model.apply)
    shape = (model.config.num_hidden_layers, model.config.num_attention_heads)

    @jax.jit
    def amax(lora, frozen, tokens, segment_ids, positions):
        kw = {"segment_ids": segment_ids, "positions": positions, "mutable": ["intermediates"]}
        _, state = adapted(frozen, lora, tokens, fp8_scales=jnp.ones(shape), **kw)
        return decoder_fp8.logit_amax(state)

    keys = ("tokens", "segment_ids", "positions")
    observed = amax(lora, frozen, *(jnp.asarray(batch[k]) for k in keys))
    return current_scale(observed, fmt=decoder_fp8.FP8_FORMAT)


def make_evaluate(config: Any, model: Any, mesh: Any, naive: jax.Array) -> Any:
    """``evaluate(adapters, frozen, packed)``: ``llm_sft_steps.make_evaluate`` at the geometry
    scales and at the naive ones (keys ``valid/naive_...``)."""
    size = config.eval.batch_size
    geometry = llm_sft_steps.make_evaluate(make_forward(config, model), mesh, batch_size=size)
    fixed = llm_sft_steps.make_evaluate(_forward(model, lambda *_: naive), mesh, batch_size=size)

    def evaluate(lora, frozen, packed):
        out = geometry(lora, frozen, packed)
        for k, v in fixed(lora, frozen, packed).items():
            out[k.replace("valid/", "valid/naive_")] = v
        return out

    return evaluate


def summary(config: Any, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The run's FP8 numbers: overflows and losses at both scales, before and after training."""
    out = {}
    for name, ev in (("before", before), ("after", after)):
        for scale in ("", "naive_"):
            out[f"{scale}fp8_overflow_{name}"] = ev[f"valid/{scale}fp8_overflow"]
            out[f"{scale}fp8_valid_loss_{name}"] = ev[f"valid/{scale}loss"]
    return out


def report_lines(config: Any, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The ``results.md`` section: overflows per layer at both scales, before and after."""
    f = config.fp8
    layers = sorted(int(k.rsplit("layer", 1)[1]) for k in after if "/fp8_overflow_layer" in k)
    head = "| scale | when | valid loss | overflows | " + " | ".join(f"layer {i}" for i in layers)
    lines = ["", "## FP8 attention logits (P14)", "", head + " |"]
    lines.append("|" + "---|" * (4 + len(layers)))
    names = {"": f"geometry-aware ({f.bound}, c={f.calibration:g})", "naive_": "amax (naive)"}
    for scale, label in names.items():
        for when, ev in (("before", before), ("after", after)):
            per_layer = [str(ev[f"valid/{scale}fp8_overflow_layer{i}"]) for i in layers]
            row = [
                label,
                when,
                f"{ev[f'valid/{scale}loss']:.4f}",
                str(ev[f"valid/{scale}fp8_overflow"]),
            ]
            lines.append("| " + " | ".join(row + per_layer) + " |")
    lines += [
        "",
        "Overflows: attended logits with |S·s| > 448 (E4M3) over the validation rows. The "
        f"geometry-aware scale is recomputed every step from the adapted W_Q, W_K (δ = "
        f"{f.delta:g}, n = {config.data.max_length}; RoPE-safe σ̄ = ‖W_Q,h‖₂‖W_K,g‖₂); the naive "
        "scale is 448/amax of the first training batch with the initial adapters.",
    ]
    return lines
