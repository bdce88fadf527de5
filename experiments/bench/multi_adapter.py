"""Benchmark: one mixed-adapter batch over 16 LoRAs vs 16 separate calls (S-LoRA / Punica style).

``python -m experiments.bench.multi_adapter`` builds a Llama-like :class:`lowrank_jax.models.
DecoderLM` (layers stacked under ``scan``; default d=256, 2 layers, vocab 1024, float32 parameters,
bfloat16 compute: ``DecoderConfig``'s defaults), ``N=16``
LoRA adapter sets (r=8 on every ``*_proj`` kernel, random factors) and ``N`` token sequences
(length ``--seq``), and times the forward (logits) of

* ``mixed``: one jitted call on the batch of ``N`` sequences with the bank of all ``N``
  adapters, ``adapter_ids = arange(N)`` (:func:`lowrank_jax.adapters.stack_adapters`, the
  ``adapter_ids=`` argument of :func:`lowrank_jax.adapters.adapt`);
* ``separate``: ``N`` jitted calls, sequence ``i`` alone with adapter set ``i`` (adapters are
  arguments, so all ``N`` calls share one compilation).

The two run interleaved in rounds (order rotated, :func:`experiments.bench.common.run_rounds`),
medians reported; ``max_abs_diff`` checks that both give the same logits, ``adapter_effect``
(the largest change of a logit from the base model) that the adapters matter. The last line printed
is a JSON object; ``mixed_vs_separate_throughput`` is the ratio of sequences per second (wall
time), ``mixed_vs_separate_cpu`` the ratio of process CPU time per batch, the steadier figure on
a shared machine.

Example::

    python -m experiments.bench.multi_adapter            # default shape, 5 timed rounds
    python -m experiments.bench.multi_adapter --quick    # seconds (tests)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import common
from lowrank_jax import adapters, models


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.multi_adapter",
        description="Throughput of one mixed-adapter batch vs one call per adapter.",
    )
    p.add_argument("--adapters", type=int, default=16, help="N: adapters = sequences")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds")
    p.add_argument("--quick", action="store_true", help="tiny shape and 4 adapters, for tests")
    args = p.parse_args(argv)
    if args.quick:
        args.adapters, args.hidden, args.layers, args.seq, args.rounds = 4, 32, 1, 8, 1
    for name in ("adapters", "hidden", "layers", "seq", "rank", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer.")
    if args.hidden % 32:
        p.error("--hidden must be a multiple of 32 (4 heads of hidden/4, 2 KV heads).")
    return args


def run(args: argparse.Namespace) -> dict:
    """Builds the model, the adapters and both ways, times them; returns the JSON row."""
    config = models.DecoderConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = models.DecoderLM(config)
    n = args.adapters
    tokens = jax.random.randint(jax.random.key(0), (n, args.seq), 0, config.vocab_size)
    variables = model.init(jax.random.key(1), tokens[:1])
    rules = [(r".*_proj/kernel", adapters.lora(args.rank, in_ndim=1, out_ndim=1))]

    def random_set(i):
        ads = adapters.init(jax.random.key(100 + i), variables, rules)
        keys = iter(jax.random.split(jax.random.key(200 + i), len(jax.tree.leaves(ads))))
        return jax.tree.map(lambda f: 0.05 * jax.random.normal(next(keys), f.shape, f.dtype), ads)

    sets = [random_set(i) for i in range(n)]
    bank = adapters.stack_adapters(sets)
    ids = jnp.arange(n, dtype=jnp.int32)
    fwd = adapters.adapt(model.apply)
    mixed_fn = jax.jit(lambda v, b, t, i: fwd(v, b, t, adapter_ids=i))
    one_fn = jax.jit(fwd)

    def mixed():
        return jax.block_until_ready(mixed_fn(variables, bank, tokens, ids))

    def separate():
        outs = [one_fn(variables, sets[i], tokens[i : i + 1]) for i in range(n)]
        return jax.block_until_ready(jnp.concatenate(outs))

    timings = common.run_rounds({"mixed": mixed, "separate": separate}, rounds=args.rounds)
    base = np.asarray(model.apply(variables, tokens), np.float32)
    effect = float(np.max(np.abs(np.asarray(timings["mixed"].first_result, np.float32) - base)))
    diff = float(np.max(np.abs(timings["mixed"].first_result - timings["separate"].first_result)))
    mixed_s, separate_s = timings["mixed"].median, timings["separate"].median
    return {
        "bench": "multi_adapter",
        "backend": jax.default_backend(),
        "adapters": n,
        "hidden": args.hidden,
        "layers": args.layers,
        "seq": args.seq,
        "rank": args.rank,
        "rounds": args.rounds,
        "mixed_s": mixed_s,
        "separate_s": separate_s,
        "mixed_seq_per_s": n / mixed_s,
        "separate_seq_per_s": n / separate_s,
        "mixed_vs_separate_throughput": separate_s / mixed_s,
        "mixed_cpu_s": timings["mixed"].cpu_median,
        "separate_cpu_s": timings["separate"].cpu_median,
        "mixed_vs_separate_cpu": timings["separate"].cpu_median / timings["mixed"].cpu_median,
        "max_abs_diff": diff,
        "adapter_effect": effect,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    row = run(parse_args(argv))
    print(
        common.markdown_table(
            ["way", "median s", "sequences/s"],
            [
                ["mixed batch", f"{row['mixed_s']:.4f}", f"{row['mixed_seq_per_s']:.1f}"],
                [
                    f"{row['adapters']} calls",
                    f"{row['separate_s']:.4f}",
                    f"{row['separate_seq_per_s']:.1f}",
                ],  # fmt: skip
            ],
        )
    )
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
