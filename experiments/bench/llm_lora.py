"""Benchmark: LoRA and QLoRA on the scanned decoder stack at a Gemma-2-2B-like width.

``python -m experiments.bench.llm_lora`` measures, on a ``DecoderLM`` with Gemma-2's switches
(GeGLU, sandwich norms, soft-capping, alternating sliding/full layers, tied embeddings) at
d=2304, MLP 9216, 8 query heads (4 key/value heads) of 256, with ``--layers`` (default 26,
Gemma-2-2B's depth: the memory is read from shapes, so nothing of the base is allocated)
layers under ``nn.scan`` with ``remat_policy="nothing_saveable"``, bf16 compute and float32 parameters;
LoRA r=8, alpha=16 on all seven projections (factors stacked on the layer axis):

* ``scan_lora_extra_over_adapter_bytes``: what LoRA adds to the compiled training step's memory
  beyond the activations, over the adapter's own bytes. Two Adam steps are AOT-compiled from
  shapes (nothing is allocated; train state donated, frozen base not): the LoRA step, and the
  frozen base's step that trains only the stacked ``input_layernorm`` scales (``(L, d)``: the
  backward runs through every frozen layer and keeps the same activations, and no weight
  gradient is formed). ``extra(T) = temp(LoRA) − temp(frozen)`` from XLA's
  ``memory_analysis()`` for a batch of ``T`` tokens (``--tokens``, default 4, 16, 64); at a few
  tokens the activations are negligible (``extra`` is flat in ``T``), so the headline is
  ``extra(min T) / adapter bytes``; larger ``T`` shows what LoRA's activations add per token.
  ``..._by_layers`` repeats it at other depths (``--depth-curve``, default 2, 4, 8). Measured:
  1.0 is the stacked factor
  gradients themselves (Adam reads them after the backward); the rest
  (``scan_lora_per_iteration_bytes = extra − adapter bytes``, 1.56 MB at 2 to 8 layers,
  1.36 MB at 26) is the
  backward scan body's copies of the current layer's factor slices (``dynamic-slice`` of the
  stacked ``a``, ``b``; XLA:CPU materialises a dot operand, as it does the layer's frozen kernel
  slices in both steps), i.e. ``layer_factor_bytes = adapter bytes / L`` (1.60 MB), so the ratio
  is ``≈ 1 + 1/L``: no copy of the base or of the stacked factors per adapter (MaxText #5129's
  re-stacking would be hundreds). ``docs/guides/decoder.md`` lists what was tried against it.
* ``nf4_base_bytes_ratio``: bytes of the projection kernels stored as NF4 (4-bit codes, one
  float32 scale per block of 64: ``adapters.low_precision_base(..., "nf4")``) over their float32
  bytes; the whole model's ratio at the benchmark vocabulary (embeddings and norms stay float32,
  as in QLoRA) is ``nf4_model_bytes_ratio``; int8 and bf16 bases beside them.
* ``lora_vs_full_step``: median wall time of a LoRA Adam step over a full fine-tuning Adam step at
  the same width with ``--time-layers`` (default 2) layers, batch ``--batch``×``--seq``
  (``qlora_vs_full_step``: LoRA on the NF4 base), interleaved rounds (``bench.common.run_rounds``).
* ``hf_logits_maxdiff``: max |logits| difference, float32, against PyTorch ``transformers`` on
  random tiny Llama, Qwen2 and Gemma-2 models (``--quick``: Llama only) saved with ``save_pretrained`` and read with
  ``load_hf_decoder`` (padded batch; None without ``torch``/``transformers``, the ``peers`` extra).

The last line printed is the JSON headline. ``--quick`` is a tiny shape (d=64, one layer) for tests.

Example::

    python -m experiments.bench.llm_lora            # a few minutes on 2 CPU cores
    python -m experiments.bench.llm_lora --quick    # seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.bench import common
from lowrank_jax import adapters, models
from lowrank_jax.adapters.paths import named_leaves
from lowrank_jax.adapters.quant import BASE_DTYPES
from lowrank_jax.models.hf_decoder_config import config_from_hf

FROZEN_PATTERN = r"params/model/layers/input_layernorm/scale"
KERNELS = r".*_proj/kernel"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.llm_lora",
        description="LoRA/QLoRA on the scanned decoder at a Gemma-2-2B-like width: memory LoRA "
        "adds to the compiled step, NF4 base bytes, LoRA vs full step time, HF logits parity.",
    )
    p.add_argument(
        "--layers", type=int, default=26, help="depth of the memory measurement (Gemma-2-2B: 26)"
    )
    p.add_argument("--tokens", default="4,16,64", help="token counts of the memory measurement")
    p.add_argument("--depth-curve", default="2,4,8", help="other depths, at the fewest tokens")
    p.add_argument("--time-layers", type=int, default=2, help="depth of the timed steps")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed rounds")
    p.add_argument("--remat", default="nothing_saveable", help="remat policy ('none': off)")
    p.add_argument(
        "--lora-matmul",
        default="factorised",
        choices=("factorised", "fused"),
        help="adapters.adapt(..., lora_matmul=...)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the transformers parity check")
    p.add_argument("--quick", action="store_true", help="tiny shape (d=64, one layer), for tests")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.time_layers, args.batch, args.seq, args.steps = 1, 1, 2, 16, 2
        args.tokens = "8" if args.tokens == "4,16,64" else args.tokens
        args.depth_curve = "" if args.depth_curve == "2,4,8" else args.depth_curve
    try:
        args.tokens = sorted({int(v) for v in args.tokens.split(",") if v.strip()})
        args.depth_curve = [int(v) for v in args.depth_curve.split(",") if v.strip()]
    except ValueError:
        p.error("--tokens and --depth-curve take comma-separated integers.")
    if not args.tokens or min(args.tokens) < 2:
        p.error(f"--tokens needs token counts >= 2, got {args.tokens}.")
    if any(v < 1 for v in args.depth_curve):
        p.error(f"--depth-curve needs positive depths, got {args.depth_curve}.")
    for name in ("layers", "time_layers", "batch", "seq", "rank", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer.")
    args.remat = None if args.remat == "none" else args.remat
    return args


def gemma_like(args: argparse.Namespace, layers: int) -> models.DecoderConfig:
    """Gemma-2's switches at d=2304 (``--quick``: d=64), ``layers`` layers."""
    if args.quick:
        width = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, head_dim=16)
        width.update(num_key_value_heads=2, vocab_size=256)
    else:
        width = dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8, head_dim=256)
        width.update(num_key_value_heads=4, vocab_size=1024)
    return models.DecoderConfig(
        family="gemma2",
        num_hidden_layers=layers,
        hidden_act="gelu_pytorch_tanh",
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=float(width["head_dim"]),
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        layer_types=("sliding_attention", "full_attention") * (layers // 2)
        + ("sliding_attention",) * (layers % 2),
        tie_word_embeddings=True,
        remat_policy=args.remat,
        dtype="bfloat16",
        **width,
    )


def _rules(rank: int) -> list:
    return [(KERNELS, adapters.lora(rank, alpha=2.0 * rank, in_ndim=1, out_ndim=1))]


def _lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    return jnp.mean(ce)


def make_steps(
    model: models.DecoderLM, tx: optax.GradientTransformation, lora_matmul: str = "factorised"
) -> dict[str, Any]:
    """``{name: step(train, opt_state, frozen, tokens) -> (train, opt_state, loss)}``."""
    adapted = adapters.adapt(model.apply, lora_matmul=lora_matmul)

    def lora_loss(lora, frozen, tokens):
        return _lm_loss(adapted(frozen, lora, tokens), tokens)

    def params_loss(trainable, frozen, tokens):  # full fine-tuning, or the frozen-base step
        params = trainable if frozen is None else adapters.combine(trainable, frozen)
        return _lm_loss(model.apply(params, tokens), tokens)

    def step_of(loss_fn):
        def step(train, opt_state, frozen, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(train, frozen, tokens)
            updates, opt_state = tx.update(grads, opt_state, train)
            return optax.apply_updates(train, updates), opt_state, loss

        return step

    return {"lora": step_of(lora_loss), "params": step_of(params_loss)}


def _compile(step: Any, tx: Any, train: Any, frozen: Any, tokens: Any) -> Any:
    opt_state = jax.eval_shape(tx.init, train)
    return jax.jit(step, donate_argnums=(0, 1)).lower(train, opt_state, frozen, tokens).compile()


def memory(args: argparse.Namespace, layers: int, tokens: Sequence[int]) -> dict[str, Any]:
    """The LoRA step's temp bytes over the frozen base's, per token count, from shapes only."""
    config = gemma_like(args, layers)
    model = models.DecoderLM(config)
    tx = optax.adam(1e-4)
    steps = make_steps(model, tx, args.lora_matmul)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    lora = jax.eval_shape(lambda v: adapters.init(jax.random.key(1), v, _rules(args.rank)), variables)  # fmt: skip
    norms, rest = adapters.split_trainable(variables, (FROZEN_PATTERN,))
    adapter_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lora))
    kernel_bytes = sum(
        x.size * x.dtype.itemsize
        for p, x in named_leaves(variables).items()
        if p.endswith("_proj/kernel")
    )
    rows = []
    for t in tokens:
        batch = jax.ShapeDtypeStruct((1, t), jnp.int32)
        lora_c = _compile(steps["lora"], tx, lora, variables, batch)
        base_c = _compile(steps["params"], tx, norms, rest, batch)
        lt = int(lora_c.memory_analysis().temp_size_in_bytes)
        bt = int(base_c.memory_analysis().temp_size_in_bytes)
        rows.append({"tokens": t, "lora_temp": lt, "frozen_temp": bt, "extra": lt - bt})
    return {
        "rows": rows,
        "adapter_bytes": int(adapter_bytes),
        "kernel_bytes": int(kernel_bytes),
        "ratio": rows[0]["extra"] / adapter_bytes,
        "config": config,
    }


def base_bytes(args: argparse.Namespace) -> dict[str, Any]:
    """Bytes of the frozen base per storage dtype (from shapes: nothing is quantised for real)."""
    model = models.DecoderLM(gemma_like(args, args.layers))
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    out = {}
    for dtype in BASE_DTYPES:
        base = jax.eval_shape(
            lambda v, d=dtype: adapters.low_precision_base(v, d, patterns=(KERNELS,)), variables
        )
        kernels = [x for p, x in named_leaves(base).items() if "_proj/kernel" in p]
        out[dtype] = {
            "model": adapters.quant.base_bytes(base),
            "kernels": adapters.quant.base_bytes(kernels),
        }
    return out


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """Median step times of full fine-tuning, LoRA (float32 base) and QLoRA (NF4 base)."""
    config = gemma_like(args, args.time_layers)
    model = models.DecoderLM(config)
    tx = optax.adam(1e-4)
    steps = make_steps(model, tx, args.lora_matmul)
    tokens = jax.random.randint(jax.random.key(2), (args.batch, args.seq), 0, config.vocab_size)
    variables = jax.jit(model.init)(jax.random.key(0), tokens[:1])
    lora = adapters.init(jax.random.key(1), variables, _rules(args.rank))
    nf4 = adapters.low_precision_base(variables, "nf4", patterns=(KERNELS,))
    cases = {
        "full": (steps["params"], variables, None),
        "lora": (steps["lora"], lora, variables),
        "qlora-nf4": (steps["lora"], lora, nf4),
    }
    runners, losses = {}, {}
    for name, (step, train, frozen) in cases.items():
        train = jax.tree.map(jnp.array, train)  # own copies: the step donates them
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(train, tx.init(train), frozen, tokens).compile()  # fmt: skip
        holder = {"train": train, "opt": tx.init(train)}

        def run(compiled=compiled, holder=holder, frozen=frozen, name=name):
            holder["train"], holder["opt"], loss = compiled(
                holder["train"], holder["opt"], frozen, tokens
            )
            losses.setdefault(name, float(jax.block_until_ready(loss)))
            return loss

        runners[name] = run
    timings = common.run_rounds(runners, rounds=args.steps, warmup=1)
    return {
        "median_s": {k: v.median for k, v in timings.items()},
        "cpu_s": {k: v.cpu_median for k, v in timings.items()},
        "loss0": losses,
        "config": config,
    }


def hf_parity(families: Sequence[str] = ("llama", "qwen2", "gemma2")) -> float | None:
    """Max |logits − transformers' logits| over random tiny models of ``families``."""
    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        return None
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    common_kw = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    configs = {
        "llama": transformers.LlamaConfig(**common_kw),
        "qwen2": transformers.Qwen2Config(**common_kw, tie_word_embeddings=False),
        "gemma2": transformers.Gemma2Config(
            **common_kw, head_dim=8, sliding_window=3, attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    }  # fmt: skip
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 96, size=(2, 10))
    mask = np.ones((2, 10), np.int64)
    mask[1, :3] = 0  # a left-padded row
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    worst = 0.0
    classes = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
    }
    for family in families:
        torch.manual_seed(0)
        cls = getattr(transformers, classes[family])
        hf = cls._from_config(configs[family], attn_implementation="eager")
        hf = hf.eval()
        with torch.no_grad():
            for key, p in hf.named_parameters():
                p.copy_(torch.randn_like(p) * (0.02 if "embed_tokens" in key else 0.3))
            theirs = hf(
                input_ids=torch.tensor(tokens),
                attention_mask=torch.tensor(mask),
                position_ids=torch.tensor(positions),
            ).logits.numpy()
        with tempfile.TemporaryDirectory() as directory:
            hf.save_pretrained(directory)
            config = config_from_hf(directory, dtype="float32")
            config, variables = models.load_hf_decoder(directory, config=config)
        ours = np.asarray(models.DecoderLM(config).apply(variables, jnp.asarray(tokens), mask))
        valid = mask.astype(bool)
        worst = max(worst, float(np.max(np.abs(ours[valid] - theirs[valid]))))
    return worst


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    mem = memory(args, args.layers, args.tokens)
    cfg = mem["config"]
    print(
        f"Gemma-2-like decoder: d={cfg.hidden_size}, MLP {cfg.intermediate_size}, "
        f"{cfg.num_attention_heads}x{cfg.head_dim} heads ({cfg.kv_heads} kv), L={cfg.num_hidden_layers}, "
        f"vocab {cfg.vocab_size}, remat={cfg.remat_policy}, {cfg.dtype} compute; LoRA r={args.rank} "
        f"on all 7 projections: {mem['adapter_bytes'] / 2**20:.2f} MiB of factors, "
        f"{mem['kernel_bytes'] / 2**20:.0f} MiB of float32 kernels."
    )  # fmt: skip
    print()
    table = [
        [r["tokens"], r["lora_temp"] / 2**20, r["frozen_temp"] / 2**20, r["extra"] / 2**20,
         r["extra"] / mem["adapter_bytes"]]
        for r in mem["rows"]
    ]  # fmt: skip
    header = [
        "tokens",
        "LoRA step temp MiB",
        "frozen step temp MiB",
        "extra MiB",
        "extra / adapter",
    ]
    print(common.markdown_table(header, table))
    by_layers = {args.layers: mem["ratio"]}
    for layers in args.depth_curve:
        by_layers[layers] = memory(args, layers, args.tokens[:1])["ratio"]
    by_layers = dict(sorted(by_layers.items()))
    print(
        f"\n# extra / adapter bytes at {args.tokens[0]} tokens by depth: "
        + ", ".join(f"L={k}: {v:.3f}" for k, v in by_layers.items())
    )
    per_iteration = mem["rows"][0]["extra"] - mem["adapter_bytes"]
    print(
        f"# beyond the stacked factor gradients at L={args.layers}: {per_iteration / 1e6:.3f} MB "
        f"(one layer's factors: {mem['adapter_bytes'] / args.layers / 1e6:.3f} MB)"
    )
    sizes = base_bytes(args)
    f32 = sizes["float32"]
    print()
    print(
        common.markdown_table(
            ["base", "kernels MiB", "× float32", "whole model MiB", "× float32"],
            [
                [k, v["kernels"] / 2**20, v["kernels"] / f32["kernels"], v["model"] / 2**20,
                 v["model"] / f32["model"]]
                for k, v in sizes.items()
            ],
        )
    )  # fmt: skip
    times = timing(args)
    med = times["median_s"]
    tcfg = times["config"]
    print(
        f"\nStep times at L={tcfg.num_hidden_layers}, batch {args.batch}x{args.seq} (Adam, "
        f"{common.num_threads()} threads, {jax.default_backend()}, median of {args.steps}):"
    )
    print(
        common.markdown_table(
            ["method", "step s", "CPU s", "× full", "first loss"],
            [[k, v, times["cpu_s"][k], v / med["full"], times["loss0"].get(k)] for k, v in med.items()],
        )
    )  # fmt: skip
    families = ("llama",) if args.quick else ("llama", "qwen2", "gemma2")
    hf = None if args.no_hf else hf_parity(families)
    headline = {
        "scan_lora_extra_over_adapter_bytes": mem["ratio"],
        "scan_lora_extra_layers": args.layers,
        "scan_lora_per_iteration_bytes": mem["rows"][0]["extra"] - mem["adapter_bytes"],
        "layer_factor_bytes": mem["adapter_bytes"] // args.layers,
        "scan_lora_extra_over_adapter_bytes_by_layers": {str(k): v for k, v in by_layers.items()},
        "scan_lora_extra_bytes_by_tokens": {str(r["tokens"]): r["extra"] for r in mem["rows"]},
        "adapter_bytes": mem["adapter_bytes"],
        "nf4_base_bytes_ratio": sizes["nf4"]["kernels"] / f32["kernels"],
        "nf4_model_bytes_ratio": sizes["nf4"]["model"] / f32["model"],
        "int8_base_bytes_ratio": sizes["int8"]["kernels"] / f32["kernels"],
        "bf16_base_bytes_ratio": sizes["bfloat16"]["kernels"] / f32["kernels"],
        "base_bytes": sizes,
        "lora_vs_full_step": med["lora"] / med["full"],
        "qlora_vs_full_step": med["qlora-nf4"] / med["full"],
        "lora_vs_full_cpu": times["cpu_s"]["lora"] / times["cpu_s"]["full"],
        "step_s": med,
        "loss0": times["loss0"],
        "hf_logits_maxdiff": hf,
        "shape": {
            "d": cfg.hidden_size, "mlp": cfg.intermediate_size, "heads": cfg.num_attention_heads,
            "head_dim": cfg.head_dim, "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size,
            "layers": args.layers, "time_layers": args.time_layers, "tokens": args.tokens,
            "batch": args.batch, "seq": args.seq, "rank": args.rank, "remat": args.remat,
            "threads": common.num_threads(),
        },
        "wall_s": time.perf_counter() - t0,
    }  # fmt: skip
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(0 if main() else 1)
