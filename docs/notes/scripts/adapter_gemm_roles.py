"""How fast XLA runs each role of the adapter-step benchmark's projection matmuls.

    python docs/notes/scripts/adapter_gemm_roles.py [--batch 64] [--rounds 5]

At the shape of ``experiments.bench.adapter_step`` (tokens = batch × seq; d=1024, mlp 4096) every
projection ``W`` (m×n) of the block takes part in three matmuls, each ``2·tokens·m·n`` FLOPs:
the forward ``x·W``, the input gradient ``dY·Wᵀ`` and the weight gradient ``xᵀ·dY``
(contracting over tokens), each written as autodiff writes it (``lax.dot_general``, no
transposed copy). Full fine-tuning runs all 18; a LoRA step runs the six forwards and the input
gradients of ``out``, ``fc1`` and ``fc2`` only (the adapters below them need those; the block's
input needs none). Each matmul is jitted alone and timed in interleaved rounds
(:func:`experiments.bench.common.run_rounds`). The last line is JSON: per-matmul median seconds
and GFLOP/s, and ``time_floor``, the LoRA step's matmul time over the full step's, against
``flop_floor``, the same ratio in FLOPs. Where the weight gradients run slower per FLOP than
the forwards, the time floor lies below the FLOP floor.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout first

PROJECTIONS = {
    "query": (1, 1),
    "key": (1, 1),
    "value": (1, 1),
    "out": (1, 1),
    "fc1": (1, 4),
    "fc2": (4, 1),
}  # (m, n) in units of d
LORA_INPUT_GRADS = ("out", "fc1", "fc2")
ROLES = {  # role -> (lhs, rhs, dimension numbers of lax.dot_general)
    "forward": ("x", "w", (((1,), (0,)), ((), ()))),
    "input_grad": ("dy", "w", (((1,), (1,)), ((), ()))),
    "weight_grad": ("x", "dy", (((0,), (0,)), ((), ()))),
}


def measure(tokens: int, d: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from experiments.bench import common

    methods, flops = {}, {}
    keys = iter(jax.random.split(jax.random.key(0), 3 * len(PROJECTIONS)))
    for name, (m, n) in PROJECTIONS.items():
        m, n = m * d, n * d
        arrays = {
            "x": jax.random.normal(next(keys), (tokens, m), jnp.float32),
            "w": jax.random.normal(next(keys), (m, n), jnp.float32),
            "dy": jax.random.normal(next(keys), (tokens, n), jnp.float32),
        }
        for role, (lhs, rhs, dims) in ROLES.items():
            f = jax.jit(lambda a, b, dims=dims: lax.dot_general(a, b, dims))
            a, b = arrays[lhs], arrays[rhs]
            methods[f"{name}/{role}"] = lambda f=f, a=a, b=b: f(a, b).block_until_ready()
            flops[f"{name}/{role}"] = 2 * tokens * m * n
    timing = common.run_rounds(methods, rounds=rounds)
    seconds = {k: t.median for k, t in timing.items()}

    lora = [f"{name}/forward" for name in PROJECTIONS]
    lora += [f"{name}/input_grad" for name in LORA_INPUT_GRADS]

    def floor(table: dict) -> float:  # the LoRA step's share of the full step's matmuls
        return round(sum(table[k] for k in lora) / sum(table.values()), 4)

    return {
        "tokens": tokens,
        "d": d,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "gflop_per_s": {k: round(flops[k] / seconds[k] / 1e9, 1) for k in seconds},
        "time_floor": floor(seconds),
        "flop_floor": floor(flops),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python docs/notes/scripts/adapter_gemm_roles.py")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.batch, args.seq, args.d, args.rounds) < 1:
        p.error("--batch, --seq, --d and --rounds must be positive integers")
    result = measure(args.batch * args.seq, args.d, args.rounds)
    for role in ROLES:
        row = ", ".join(f"{name} {result['gflop_per_s'][f'{name}/{role}']}" for name in PROJECTIONS)
        print(f"{role:>12} GFLOP/s: {row}")
    print(f"matmul time floor {result['time_floor']:.3f} vs FLOP floor {result['flop_floor']:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
