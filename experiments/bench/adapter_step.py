"""Benchmark: one training step of a pre-LN transformer block, full fine-tuning vs LoRA ways.

``python -m experiments.bench.adapter_step`` builds one
:class:`lowrank_jax.models.layers.PreLNBlock` (default d=1024, mlp 4096, 16 heads, f32), a batch
of 64×128 tokens and a squared-error loss against a fixed random target, and times one Adam step
(``optax.adam``, jitted, train state donated, frozen parameters not donated) of

* ``full``: full fine-tuning (every parameter trains);
* ``merge``: LoRA by merge-at-apply, ``W + s·A·B`` formed inside every forward
  (``model.apply(adapters.fold(variables, ad), x)``), so autodiff forms ``∂L/∂W'`` (m×n);
* ``lora-quax`` / ``lora-linen``: the factorised path ``adapters.adapt(model.apply, backend=...)``,
  ``x·W + s·(x·A)·B``, with no weight-shaped gradient;
* ``lora-fused``: ``adapters.adapt(model.apply, lora_matmul="fused")``: one matmul
  ``x·(W + s·A·B)`` per projection with a hand-written backward
  (:mod:`lowrank_jax.adapters.fused`): no weight gradient, and no second token-sized buffer per
  projection (the headline LoRA step);
* ``dora-quax``: DoRA (:func:`lowrank_jax.adapters.dora`, same rank and targets) on the factorised
  path: the LoRA product plus the detached column norm ``‖W + s·A·B‖`` from an ``(r, m)`` product
  with the frozen kernel;
* ``lora-bf16`` / ``lora-int8``: ``lora-fused`` on a frozen base stored in bfloat16 / int8
  (``adapters.low_precision_base``; float32 adapters, Adam state and output);
* ``peft``: Hugging Face PEFT's LoRA on PyTorch (CPU, same thread count) for the same block,
  same weights, batch and loss (when ``torch`` and ``peft`` are installed: the ``peers`` extra).

LoRA is r=8, alpha=16 on ``query, key, value, out, fc1, fc2``. The methods run interleaved in
rounds (order rotated) and the table gives the median step time, XLA's compiled memory and FLOP
count, the weight-shaped matmuls left in the optimised HLO, peak RSS while the step runs, and the
trainable + optimizer-state bytes (LoRA: ``3 · 4 B · Σ r·(m+n)``). The last line printed is a JSON
object of the headline ratios.

Both median wall time and median process CPU time per step are reported; on a shared machine the
CPU time is the steadier comparison.

Then the **memory curve** (``--depths 1,2,4,8``, batch ``--curve-batch``×seq): ``full``, ``lora``
(fused, f32 base), ``lora-bf16``, ``lora-int8`` and ``peft`` on 1, 2, 4, 8 stacked blocks, each
(depth, method) in its own process so that its peak RSS is its own; columns: step time, peak RSS
during the step, XLA temp and temp + argument bytes (``memory_analysis``, load-independent), and
the trainable + optimizer state. The plot goes to ``<--out>/memory_curve.png``; the rows are also
under ``"curve"`` in the final JSON line, whose headline keys ``lora_vs_full_step``,
``lora_vs_full_temp_bytes`` and ``lora_vs_peft_rss`` are the single-block ``lora-fused`` figures
(``lora_vs_peft_rss_rise``: its RSS rise during the step over PEFT's, without the RSS that every
method shares in the one process).

Default run: the single-block table plus the curve; see ``docs/notes/adapter_step_bench.md`` for the measured
numbers and times. ``--depths ''`` skips the curve; ``--quick`` is a tiny shape without the curve,
for tests.

Example::

    python -m experiments.bench.adapter_step              # the full shape, 3 timed rounds
    python -m experiments.bench.adapter_step --quick      # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.bench import common
from lowrank_jax import adapters
from lowrank_jax.adapters.paths import named_leaves
from lowrank_jax.models.layers import PreLNBlock

TARGETS = ("query", "key", "value", "out", "fc1", "fc2")
RULES_PATTERN = r".*(query|key|value|out|fc1|fc2)/kernel"
MB = 1 << 20
# The memory curve: methods (one process per cell) and what each one trains.
CURVE_METHODS = ("full", "lora", "lora-bf16", "lora-int8", "peft")
LOW_PRECISION = {"lora-bf16": "bfloat16", "lora-int8": "int8"}


class Blocks(nn.Module):
    """``depth`` pre-LN blocks in a row (``depth == 1`` is a bare :class:`PreLNBlock`)."""

    depth: int
    num_heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.depth):
            x = PreLNBlock(self.num_heads, self.mlp_dim, name=f"block_{i}")(x)
        return x


def make_model(args: argparse.Namespace, depth: int = 1) -> nn.Module:
    if depth == 1:
        return PreLNBlock(num_heads=args.heads, mlp_dim=args.mlp)
    return Blocks(depth, args.heads, args.mlp)


@dataclasses.dataclass
class Method:
    """One benchmarked way to train: how to run a step and what was measured statically."""

    name: str
    run: Callable[[], float]  # one step, blocking; returns the loss before the update
    state_bytes: int  # trainable parameters + optimizer state
    trainable: int  # number of trainable scalars
    stats: common.CompileStats | None = None
    weight_dots: list[str] | None = None
    loss0: float | None = None  # loss at the initial parameters, when not from the first run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.adapter_step",
        description="Step time and memory: full fine-tuning vs merge-at-apply vs factorised "
        "LoRA (quax, linen) vs PyTorch PEFT, on one pre-LN transformer block.",
    )
    p.add_argument("--steps", type=int, default=3, help="timed rounds (one step per method each)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d", type=int, default=1024, help="model width")
    p.add_argument("--mlp", type=int, default=None, help="MLP width (default 4·d)")
    p.add_argument("--heads", type=int, default=None, help="heads (default 16, at most d/16)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peft", action="store_true", help="skip PyTorch PEFT even if installed")
    p.add_argument(
        "--depths",
        default="1,2,4,8",
        help="memory curve: comma-separated depths (blocks), one process per (depth, method); "
        "'' skips the curve",
    )
    p.add_argument("--curve-batch", type=int, default=4, help="memory curve: sequences per batch")
    p.add_argument("--curve-steps", type=int, default=2, help="memory curve: timed steps per cell")
    p.add_argument("--out", default="runs/bench_adapter_step", help="where the curve plot goes")
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # internal: one curve cell
    p.add_argument("--depth", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny shape (d=64, batch 3×16, 2 rounds, no memory curve) for tests",
    )
    args = p.parse_args(argv)
    if args.quick:
        # 48 tokens: no activation has a weight's shape, so the HLO check stays unambiguous.
        args.batch, args.seq, args.d, args.steps, args.warmup = 3, 16, 64, 2, 1
        args.curve_batch, args.curve_steps = 2, 1
        if args.depths == "1,2,4,8":
            args.depths = ""  # the curve is one process per cell: pass --depths to run it
    args.mlp = args.mlp or 4 * args.d
    args.heads = args.heads or max(1, min(16, args.d // 16))
    try:
        args.depths = [int(v) for v in args.depths.split(",") if v.strip()]
    except ValueError:
        p.error(f"--depths must be comma-separated integers, got {args.depths!r}.")
    if any(v < 1 for v in args.depths):
        p.error(f"--depths must be positive, got {args.depths}.")
    if args.cell is not None and args.cell not in CURVE_METHODS:
        p.error(f"--cell must be one of {CURVE_METHODS}, got {args.cell!r}.")
    for name in (
        "steps",
        "batch",
        "seq",
        "d",
        "mlp",
        "heads",
        "rank",
        "curve_batch",
        "curve_steps",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}.")
    if args.d % args.heads:
        p.error(f"--heads={args.heads} must divide --d={args.d}.")
    if args.rank > min(args.d, args.mlp):
        p.error(f"--rank={args.rank} must be at most min(d, mlp) = {min(args.d, args.mlp)}.")
    return args


def _mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(pred - target))


def _compile_step(
    loss_fn: Callable, optimizer: optax.GradientTransformation, train: Any, frozen: Any, x, y
) -> tuple[Any, Any, Any]:
    """AOT-compiles ``step(train, opt_state, frozen, x, y)`` with ``(train, opt_state)`` donated."""

    def step(train, opt_state, frozen, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(train, frozen, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, loss

    opt_state = optimizer.init(train)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(train, opt_state, frozen, x, y).compile()
    return compiled, opt_state, step


def _jax_method(
    name: str,
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    train: Any,
    frozen: Any,
    x: jax.Array,
    y: jax.Array,
    weight_shapes: list[tuple[int, int]],
    tokens: int,
) -> Method:
    # Own copies: the step donates them, and the methods must not share buffers.
    train = jax.tree.map(jnp.array, train)
    compiled, opt_state, _ = _compile_step(loss_fn, optimizer, train, frozen, x, y)
    stats = common.compile_stats(compiled)
    holder = {"train": train, "opt": opt_state}

    def run() -> float:
        t, o, loss = compiled(holder["train"], holder["opt"], frozen, x, y)
        holder["train"], holder["opt"] = t, o
        return float(jax.block_until_ready(loss))

    return Method(
        name=name,
        run=run,
        state_bytes=common.tree_bytes(train) + common.tree_bytes(opt_state),
        trainable=adapters.count_params(train),
        stats=stats,
        weight_dots=common.weight_shaped_dots(stats.hlo, weight_shapes, min_contraction=tokens),
    )


def _dora(args: argparse.Namespace, variables: Any) -> Any:
    """DoRA adapters (same rank, alpha and targets as the LoRA ones; start at the base model)."""
    rules = [(RULES_PATTERN, adapters.dora(args.rank, alpha=args.alpha))]
    return adapters.init(jax.random.key(0), variables, rules)


def build_jax_methods(
    args: argparse.Namespace,
    model: nn.Module,
    variables: Any,
    ad: Any,
    x,
    y,
    names: Sequence[str] | None = None,
) -> list[Method]:
    """The JAX methods over the same block, batch and (zero-initialised) adapters."""
    optimizer = optax.adam(args.lr)
    weight_shapes = [
        tuple(leaf.shape)
        for path, leaf in named_leaves(variables).items()
        if path.endswith("kernel")
    ]
    quax_fwd = adapters.adapt(model.apply, backend="quax")
    linen_fwd = adapters.adapt(model.apply, backend="linen")
    fused_fwd = adapters.adapt(model.apply, lora_matmul="fused")
    fused_loss = lambda a, v, x, y: _mse(fused_fwd(v, a, x), y)
    losses = {
        "full": (lambda p, _, x, y: _mse(model.apply(p, x), y), variables, None),
        "merge": (lambda a, v, x, y: _mse(model.apply(adapters.fold(v, a), x), y), ad, variables),
        "lora-quax": (lambda a, v, x, y: _mse(quax_fwd(v, a, x), y), ad, variables),
        "lora-linen": (lambda a, v, x, y: _mse(linen_fwd(v, a, x), y), ad, variables),
        "lora-fused": (fused_loss, ad, variables),
        "dora-quax": (
            lambda a, v, x, y: _mse(quax_fwd(v, a, x), y),
            _dora(args, variables),
            variables,
        ),
    }
    for name, dtype in LOW_PRECISION.items():
        frozen = adapters.low_precision_base(variables, dtype, patterns=(RULES_PATTERN,))
        losses[name] = (fused_loss, ad, frozen)
    methods = []
    for name, (loss_fn, train, frozen) in losses.items():
        if names is not None and name not in names:
            continue
        t0 = time.perf_counter()
        methods.append(
            _jax_method(
                name,
                loss_fn,
                optimizer,
                train,
                frozen,
                x,
                y,
                weight_shapes,
                math.prod(x.shape[:-1]),
            )
        )
        print(f"# compiled {name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return methods


def _peft_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "peft"))


def build_peft_method(
    args: argparse.Namespace, variables: Any, ad: Any, x: jax.Array, y: jax.Array
) -> Method:
    """PEFT LoRA on the equivalent PyTorch block, with the JAX weights and adapters copied in."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn
    from torch import nn as nn_torch

    torch.set_num_threads(common.num_threads())
    d, heads, mlp = args.d, args.heads, args.mlp

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key, self.value, self.out = (nn.Linear(d, d) for _ in range(4))

        def forward(self, h):
            b, t, _ = h.shape
            k = d // heads

            def split(z):
                return z.view(b, t, heads, k).transpose(1, 2)  # (b, h, t, k)

            q, key, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
            probs = torch.softmax(q @ key.transpose(-1, -2) / math.sqrt(k), dim=-1)
            return self.out((probs @ v).transpose(1, 2).reshape(b, t, d))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, mlp), nn.Linear(mlp, d)

        def forward(self, h):
            return self.fc2(nn.functional.gelu(self.fc1(h), approximate="tanh"))

    class Block(nn.Module):  # PreLNBlock, module for module
        def __init__(self):
            super().__init__()
            self.ln_attention, self.ln_mlp = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
            self.attention, self.mlp = Attention(), MLP()

        def forward(self, h):
            h = h + self.attention(self.ln_attention(h))
            return h + self.mlp(self.ln_mlp(h))

    def t(a: Any) -> torch.Tensor:
        return torch.from_numpy(np.array(a, dtype=np.float32))

    depth = 1 if "attention" in variables["params"] else len(variables["params"])
    blocks = [Block() for _ in range(depth)]
    block_params = (
        [variables["params"]]
        if depth == 1
        else [variables["params"][f"block_{i}"] for i in range(depth)]
    )
    with torch.no_grad():
        for block, p in zip(blocks, block_params, strict=True):
            for ln in ("ln_attention", "ln_mlp"):
                getattr(block, ln).weight.copy_(t(p[ln]["scale"]))
                getattr(block, ln).bias.copy_(t(p[ln]["bias"]))
            for parent, names in (("attention", TARGETS[:4]), ("mlp", TARGETS[4:])):
                for n in names:
                    lin = getattr(getattr(block, parent), n)
                    lin.weight.copy_(t(p[parent][n]["kernel"]).T)
                    lin.bias.copy_(t(p[parent][n]["bias"]))
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(TARGETS))
    model = get_peft_model(blocks[0] if depth == 1 else nn_torch.Sequential(*blocks), config)
    with torch.no_grad():
        for path, a in ad.items():
            parts = path.split("/")[1:-1]  # [block_i,] parent, name
            parent, n = parts[-2], parts[-1]
            root = model.base_model.model
            if depth > 1:
                root = root[int(parts[0].removeprefix("block_"))]
            lin = getattr(getattr(root, parent), n)
            lin.lora_A["default"].weight.copy_(t(a.factors["a"]).T)
            lin.lora_B["default"].weight.copy_(t(a.factors["b"]).T)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.Adam(params, lr=args.lr)
    tx, ty = t(x), t(y)

    def run() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.mean(torch.square(model(tx) - ty))
        loss.backward()
        opt.step()
        return float(loss.detach())

    loss0 = run()  # creates Adam's state, so that it can be counted (this step is not timed)
    state = sum(q.nbytes for q in params) + sum(
        v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return Method(
        name="peft",
        run=run,
        state_bytes=state,
        trainable=sum(q.numel() for q in params),
        loss0=loss0,
    )


def lora_state_formula(args: argparse.Namespace) -> int:
    """``3 · 4 B · Σ r·(m+n)``: factors, Adam's mu and nu, in f32 (Adam's count aside)."""
    d, f, r = args.d, args.mlp, args.rank
    return 3 * 4 * r * (4 * (d + d) + (d + f) + (f + d))


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def report(
    args: argparse.Namespace, methods: list[Method], timings: dict[str, common.Timing]
) -> tuple[str, dict[str, Any]]:
    """The markdown table and the headline JSON dict."""
    by = {m.name: m for m in methods}
    med = {n: timings[n].median for n in timings}
    cpu = {n: timings[n].cpu_median for n in timings}
    full, peft = med["full"], med.get("peft")
    header = [
        "method",
        "step s (median)",
        "× full",
        "× PEFT",
        "CPU s/step",
        "CPU × full",
        "CPU × PEFT",
        "GFLOP/step (XLA)",
        "weight-shaped dots",
        "XLA temp MB",
        "XLA temp+arg+out MB",
        "peak RSS MB",
        "RSS rise MB",
        "trainable",
        "trainable+opt state MB",
        "loss₀",
    ]
    loss0 = {m.name: timings[m.name].first_result if m.loss0 is None else m.loss0 for m in methods}
    rows = []
    for m in methods:
        s, tm = m.stats, timings[m.name]
        rows.append(
            [
                m.name,
                med[m.name],
                _ratio(med[m.name], full),
                _ratio(med[m.name], peft),
                cpu[m.name],
                _ratio(cpu[m.name], cpu["full"]),
                _ratio(cpu[m.name], cpu.get("peft")),
                None if s is None else s.flops / 1e9,
                "n/a" if m.weight_dots is None else len(m.weight_dots),
                None if s is None else s.temp / MB,
                None if s is None else s.total / MB,
                tm.peak_rss / MB,
                tm.rss_rise / MB,
                f"{m.trainable:,}",
                m.state_bytes / MB,
                f"{loss0[m.name]:.7g}",
            ]
        )
    table = common.markdown_table(header, rows)
    f32_loss0 = [v for n, v in loss0.items() if n not in LOW_PRECISION]
    lora, fused = by["lora-quax"], by["lora-fused"]
    headline = {
        # The headline LoRA step is the fused one (adapt(..., lora_matmul="fused")).
        "lora_vs_full_step": _ratio(med["lora-fused"], full),
        "lora_vs_full_temp_bytes": _ratio(fused.stats.temp, by["full"].stats.temp),
        "lora_vs_peft_rss": _ratio(timings["lora-fused"].peak_rss, timings["peft"].peak_rss)
        if "peft" in timings
        else None,
        # The step's own transient (peak − RSS before the step) next to PEFT's: the peak RSS of
        # one process holding every method shares the rest (docs/notes/scripts/adapter_rss_phases.py).
        "lora_vs_peft_rss_rise": _ratio(timings["lora-fused"].rss_rise, timings["peft"].rss_rise)
        if "peft" in timings
        else None,
        "lora_vs_full_cpu_fused": _ratio(cpu["lora-fused"], cpu["full"]),
        "lora_vs_peft_step_fused": _ratio(med["lora-fused"], peft),
        "lora_fused_weight_shaped_dots": len(fused.weight_dots or []),
        "factorised_vs_full_temp_bytes": _ratio(lora.stats.temp, by["full"].stats.temp),
        "factorised_vs_full_step": _ratio(med["lora-quax"], full),
        "linen_vs_full_step": _ratio(med["lora-linen"], full),
        "merge_vs_full_step": _ratio(med["merge"], full),
        "lora_vs_peft_step": _ratio(med["lora-quax"], peft),
        "lora_vs_full_cpu": _ratio(cpu["lora-quax"], cpu["full"]),
        "lora_vs_peft_cpu": _ratio(cpu["lora-quax"], cpu.get("peft")),
        "linen_vs_peft_step": _ratio(med["lora-linen"], peft),
        "lora_vs_full_flops": _ratio(lora.stats.flops, by["full"].stats.flops),
        "lora_vs_full_xla_bytes": _ratio(lora.stats.total, by["full"].stats.total),
        "lora_vs_full_rss_rise": _ratio(timings["lora-quax"].rss_rise, timings["full"].rss_rise),
        "lora_weight_shaped_dots": len(lora.weight_dots or []),
        "lora_state_bytes": lora.state_bytes,
        "lora_state_bytes_formula": lora_state_formula(args),
        "full_state_bytes": by["full"].state_bytes,
        "peft_state_bytes": by["peft"].state_bytes if "peft" in by else None,
        "step_s": {n: med[n] for n in med},
        "cpu_s": {n: cpu[n] for n in cpu},
        "all_step_s": {n: [round(t, 4) for t in timings[n].times] for n in timings},
        "loss0_spread": max(f32_loss0) - min(f32_loss0),
        "loss0_low_precision": {n: loss0[n] for n in LOW_PRECISION if n in loss0},
        "shape": {
            "batch": args.batch,
            "seq": args.seq,
            "d": args.d,
            "mlp": args.mlp,
            "heads": args.heads,
            "rank": args.rank,
            "threads": common.num_threads(),
        },
    }
    return table, headline


def run_cell(args: argparse.Namespace) -> dict[str, Any]:
    """One memory-curve cell: ``args.cell`` at ``args.depth`` blocks, alone in this process."""
    import gc

    kx, ky, kp, ka = jax.random.split(jax.random.key(args.seed), 4)
    shape = (args.curve_batch, args.seq, args.d)
    x, y = jax.random.normal(kx, shape), jax.random.normal(ky, shape)
    model = make_model(args, args.depth)
    variables = model.init(kp, x[:1])
    ad = adapters.init(ka, variables, [(RULES_PATTERN, adapters.lora(args.rank, alpha=args.alpha))])
    if args.cell == "peft":
        method = build_peft_method(args, variables, ad, x, y)
    else:
        name = "lora-fused" if args.cell == "lora" else args.cell
        (method,) = build_jax_methods(args, model, variables, ad, x, y, names=[name])
    del variables, ad  # what the step needs is held by the method
    gc.collect()
    timing = common.run_rounds({args.cell: method.run}, rounds=args.curve_steps, warmup=1)
    t = timing[args.cell]
    st = method.stats
    return {
        "method": args.cell,
        "depth": args.depth,
        "step_s": t.median,
        "cpu_s": t.cpu_median,
        "peak_rss": t.peak_rss,
        "xla_temp": None if st is None else st.temp,
        "xla_temp_args": None if st is None else st.temp + st.argument,
        "state_bytes": method.state_bytes,
    }


def run_curve(args: argparse.Namespace, use_peft: bool) -> list[dict[str, Any]]:
    """Every (depth, method) cell in its own process (clean peak RSS); returns their JSON rows."""
    shape = ["--seq", str(args.seq), "--d", str(args.d), "--mlp", str(args.mlp)]
    shape += ["--heads", str(args.heads), "--rank", str(args.rank), "--alpha", str(args.alpha)]
    shape += ["--curve-batch", str(args.curve_batch), "--curve-steps", str(args.curve_steps)]
    rows = []
    for depth in args.depths:
        for method in CURVE_METHODS:
            if method == "peft" and not use_peft:
                continue
            cmd = [sys.executable, "-m", "experiments.bench.adapter_step", "--cell", method]
            cmd += ["--depth", str(depth), "--seed", str(args.seed), *shape]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"curve cell {method} x{depth} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(
                f"# curve {method} depth {depth}: {time.perf_counter() - t0:.0f}s", file=sys.stderr
            )
    return rows


def curve_table(rows: list[dict[str, Any]]) -> str:
    header = ["depth", "method", "step s", "CPU s/step", "peak RSS MB", "XLA temp MB",
              "XLA temp+args MB", "trainable+opt state MB"]  # fmt: skip
    mb = lambda v: None if v is None else v / MB
    body = [
        [
            r["depth"],
            r["method"],
            r["step_s"],
            r["cpu_s"],
            mb(r["peak_rss"]),
            mb(r["xla_temp"]),
            mb(r["xla_temp_args"]),
            mb(r["state_bytes"]),
        ]  # fmt: skip
        for r in rows
    ]
    return common.markdown_table(header, body)


def plot_curve(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("peak_rss", "peak RSS (MB)"), ("xla_temp_args", "XLA temp + args (MB)"),
              ("step_s", "step time (s, median)"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for method in CURVE_METHODS:
            pts = [(r["depth"], r[key]) for r in rows if r["method"] == method and r[key]]
            if pts:
                scale = 1.0 if key == "step_s" else 1.0 / MB
                ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], "o-", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.cell is not None:
        row = run_cell(args)
        print(json.dumps(row))
        return row
    kx, ky, kp, ka = jax.random.split(jax.random.key(args.seed), 4)
    x = jax.random.normal(kx, (args.batch, args.seq, args.d), jnp.float32)
    y = jax.random.normal(ky, (args.batch, args.seq, args.d), jnp.float32)
    model = make_model(args)
    variables = model.init(kp, x[:1])
    rules = [(RULES_PATTERN, adapters.lora(rank=args.rank, alpha=args.alpha))]
    ad = adapters.init(ka, variables, rules)
    methods = build_jax_methods(args, model, variables, ad, x, y)
    use_peft = not args.no_peft and _peft_available()
    if use_peft:
        methods.append(build_peft_method(args, variables, ad, x, y))
    t0 = time.perf_counter()
    timings = common.run_rounds(
        {m.name: m.run for m in methods}, rounds=args.steps, warmup=args.warmup
    )
    print(f"# timed in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    table, headline = report(args, methods, timings)
    print(
        f"One pre-LN block, d={args.d}, mlp={args.mlp}, {args.heads} heads, batch "
        f"{args.batch}×{args.seq} tokens, f32, Adam; LoRA r={args.rank}, alpha={args.alpha:g} on "
        f"{', '.join(TARGETS)}. {common.num_threads()} threads (JAX {jax.__version__}, "
        f"{jax.default_backend()}), median of {args.steps} interleaved steps after {args.warmup} "
        "warm-up round(s). lora-fused: adapt(..., lora_matmul='fused'); lora-bf16 / lora-int8: "
        "lora-fused on a bfloat16 / int8 frozen base (float32 adapters, Adam state and output)."
        + ("" if use_peft else " PEFT: not run (install the `peers` extra).")
    )
    print()
    print(table)
    print()
    for m in methods:
        if m.weight_dots:
            print(f"# {m.name}: weight-shaped dots: {', '.join(sorted(set(m.weight_dots)))}")
    del methods, timings, variables, ad, x, y
    if args.depths:
        rows = run_curve(args, use_peft)
        title = (
            f"Memory curve: d={args.d}, batch {args.curve_batch}×{args.seq}, LoRA r={args.rank}; "
            "one process per cell"
        )
        print()
        print(title)
        print()
        print(curve_table(rows))
        plot = os.path.join(args.out, "memory_curve.png")
        plot_curve(rows, plot, title)
        print(f"# plot: {plot}")
        headline["curve"] = rows
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
