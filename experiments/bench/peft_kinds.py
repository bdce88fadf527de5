"""Benchmark: one training step of LoRA, FrameFT, FourierFT, SBVI and AdaLoRA on a MiniLM block.

``python -m experiments.bench.peft_kinds`` builds one
:class:`lowrank_jax.models.layers.PreLNBlock` with all-MiniLM-L6-v2's shapes (d = 384, MLP 1536,
12 heads, f32), a batch of 16×64 tokens and a squared-error loss against a fixed random target, and
times one jitted optimiser step (train state donated, frozen weights not) of each adapter kind on
``query, key, value, out, fc1, fc2``:

* ``lora``: LoRA r = 8 (Adam) — the reference budget ``P = Σ r (n + m)``;
* ``frameft``: FrameFT (``L = 2``, FFT application) with ``P / 6`` coefficients per kernel, the
  same total budget; ``frameft-10%``: a tenth of it (FrameFT's operating point);
* ``fourierft``: FourierFT with ``P / 6`` coefficients per kernel;
* ``sbvi``: spectral adapters r = 8 trained by :func:`lowrank_jax.optim.scale_by_sbvi`;
* ``adalora``: spectral adapters r = 8 trained by :func:`lowrank_jax.optim.scale_by_adalora`
  around Adam (plus its orthogonality regulariser in the loss).

Methods run interleaved in rounds (order rotated); the table gives the median step time, CPU time,
XLA's FLOPs and temp memory, peak RSS, trainable parameters and the optimiser-state bytes. The last
line printed is a JSON object of the headline ratios (FrameFT's parameters and step time relative
to LoRA, SBVI's optimiser state relative to AdaLoRA's).

Example::

    python -m experiments.bench.peft_kinds           # about 2-4 min on 2 shared CPU cores
    python -m experiments.bench.peft_kinds --quick   # a tiny shape, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from experiments.bench import common
from lowrank_jax import adapters, optim
from lowrank_jax.models.layers import PreLNBlock
from lowrank_jax.optim.adalora import adalora_orthogonality

PATTERN = r".*(query|key|value|out|fc1|fc2)/kernel"
MB = 1 << 20


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.peft_kinds",
        description="Step time and memory of PEFT parameterisations on a MiniLM-shaped block.",
    )
    p.add_argument("--steps", type=int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d", type=int, default=384)
    p.add_argument("--mlp", type=int, default=1536)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--quick", action="store_true", help="tiny shape for tests")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.d, args.mlp, args.heads, args.steps = 2, 8, 32, 64, 2, 2
    for name in ("steps", "batch", "seq", "d", "mlp", "heads", "rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer.")
    if args.d % args.heads or args.d % 2 or args.mlp % 2:
        p.error("--heads must divide --d, and --d and --mlp must be even (frame bases).")
    return args


def _mse(a, b):
    return jnp.mean(jnp.square(a - b))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = PreLNBlock(num_heads=args.heads, mlp_dim=args.mlp)
    kx, kp, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.batch, args.seq, args.d))
    y = jax.random.normal(ky, (args.batch, args.seq, args.d))
    variables = model.init(kp, x)
    fwd = adapters.adapt(model.apply)
    r = args.rank
    lora_params = 4 * r * 2 * args.d + 2 * r * (args.d + args.mlp)
    per_kernel = lora_params // 6
    specs = {
        "lora": (adapters.lora(r, alpha=2.0 * r), optax.adam(args.lr)),
        "frameft": (adapters.frameft(per_kernel), optax.adam(args.lr)),
        "frameft-10%": (adapters.frameft(per_kernel // 10), optax.adam(args.lr)),
        "fourierft": (adapters.fourierft(per_kernel), optax.adam(args.lr)),
        "sbvi": (adapters.spectral(r), optim.scale_by_sbvi(learning_rate=args.lr)),
        "adalora": (
            adapters.spectral(r, init="adalora"),
            optim.scale_by_adalora(
                inner=optax.adam(args.lr), target_rank=max(r // 2, 1), total_steps=1000
            ),
        ),
    }
    runs, info = {}, {}
    for name, (spec, tx) in specs.items():
        ad = adapters.init(jax.random.key(1), variables, [(PATTERN, spec)])
        orth = name == "adalora"

        def loss_fn(a, v, xx, yy, orth=orth):
            out = _mse(fwd(v, a, xx), yy)
            return out + 0.1 * adalora_orthogonality(a) if orth else out

        def step(a, s, v, xx, yy, tx=tx, loss_fn=loss_fn):
            loss, g = jax.value_and_grad(loss_fn)(a, v, xx, yy)
            u, s = tx.update(g, s, a)
            return optax.apply_updates(a, u), s, loss

        state = tx.init(ad)
        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(ad, state, variables, x, y).compile()
        print(f"# compiled {name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        info[name] = {
            "stats": common.compile_stats(compiled),
            "trainable": adapters.count_params(ad),
            "trainable_bytes": common.tree_bytes(ad),
            "state_bytes": common.tree_bytes(state),
        }
        holder = {"a": jax.tree.map(jnp.array, ad), "s": state}

        def run(holder=holder, compiled=compiled):
            a, s, loss = compiled(holder["a"], holder["s"], variables, x, y)
            holder["a"], holder["s"] = a, s
            return float(jax.block_until_ready(loss))

        runs[name] = run
    timings = common.run_rounds(runs, rounds=args.steps, warmup=args.warmup)
    header = [
        "method", "step s (median)", "× LoRA", "CPU s/step", "GFLOP/step (XLA)", "XLA temp MB",
        "peak RSS MB", "trainable", "× LoRA params", "opt state KB", "trainable+opt KB",
    ]  # fmt: skip
    lora_t, lora_p = timings["lora"].median, info["lora"]["trainable"]
    rows = []
    for name in specs:
        t, i = timings[name], info[name]
        rows.append(
            [
                name, t.median, t.median / lora_t, t.cpu_median, i["stats"].flops / 1e9,
                i["stats"].temp / MB, t.peak_rss / MB, f"{i['trainable']:,}",
                i["trainable"] / lora_p, i["state_bytes"] / 1024,
                (i["state_bytes"] + i["trainable_bytes"]) / 1024,
            ]
        )  # fmt: skip
    print(
        f"# PreLNBlock d={args.d} mlp={args.mlp} heads={args.heads}, batch {args.batch}x{args.seq},"
        f" {args.steps} rounds, {common.num_threads()} threads"
    )
    print(common.markdown_table(header, rows))
    headline = {
        "frameft10_params_vs_lora": info["frameft-10%"]["trainable"] / lora_p,
        "frameft10_step_vs_lora": timings["frameft-10%"].median / lora_t,
        "frameft_step_vs_lora": timings["frameft"].median / lora_t,
        "fourierft_step_vs_lora": timings["fourierft"].median / lora_t,
        "sbvi_step_vs_lora": timings["sbvi"].median / lora_t,
        "adalora_step_vs_lora": timings["adalora"].median / lora_t,
        "sbvi_state_vs_adalora": info["sbvi"]["state_bytes"] / info["adalora"]["state_bytes"],
        "frameft_state_vs_lora": info["frameft"]["state_bytes"] / info["lora"]["state_bytes"],
    }
    headline = {k: round(v, 4) for k, v in headline.items()}
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    main()
