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

Greedy decoding (``models.generate`` with a KV cache, ``--new-tokens`` steps) with
``--decode-adapters`` adapters spread over the ``N`` rows (row ``i`` uses adapter ``i mod K``) is
timed four ways in the same rounds: ``mixed`` (the bank, gathered per row), ``base`` (the base
model, no adapter), ``single`` (one adapter set for the whole batch) and ``onehot`` (the bank
applied by the one-hot einsum formulation of the JAX serving stacks' BGMV,
``factors_i = onehot(ids)_i · bank``). The JSON row gives ``mixed_vs_base_throughput`` (tokens/s
of mixed over base; vLLM on a TPU v6e reports 0.76–0.92 for Llama-3.1-8B),
``mixed_vs_single_throughput`` and ``mixed_vs_onehot_einsum`` (targets of issue #46: ≥ 0.80,
≥ 0.9, ≥ 1.0), with the model size, batch and rank they were measured at.

Example::

    python -m experiments.bench.multi_adapter            # default shape, 5 timed rounds
    python -m experiments.bench.multi_adapter --quick    # seconds (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import common
from lowrank_jax import adapters, models
from lowrank_jax.adapters import mixed


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
    p.add_argument("--decode-adapters", type=int, default=8, help="K: adapters over the rows")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy decoding steps")
    p.add_argument("--quick", action="store_true", help="tiny shape and 4 adapters, for tests")
    args = p.parse_args(argv)
    if args.quick:
        args.adapters, args.hidden, args.layers, args.seq, args.rounds = 4, 32, 1, 8, 1
        args.decode_adapters, args.new_tokens = 2, 4
    for name in ("adapters", "hidden", "layers", "seq", "rank", "rounds", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer.")
    if not 1 <= args.decode_adapters <= args.adapters:
        p.error("--decode-adapters must lie in [1, --adapters].")
    if args.hidden % 32:
        p.error("--hidden must be a multiple of 32 (4 heads of hidden/4, 2 KV heads).")
    return args


@dataclasses.dataclass(frozen=True)
class OneHotBank(mixed.AdapterBank):
    """The bank selected per row by a one-hot matmul (``onehot(ids) @ factors``), as the JAX
    serving stacks write BGMV, instead of the library's gather: the baseline of the decode rows."""

    def _per_example(self, factors: dict, x: jax.Array) -> tuple[dict, jax.Array]:
        onehot = jax.nn.one_hot(factors["ids"], self.size)
        picked = {
            k: jnp.einsum("bn,n...->b...", onehot.astype(v.dtype), v)
            for k, v in factors.items()
            if k != "ids"
        }
        tokens = x.shape[0]
        return picked, x.reshape(self.batch, tokens // self.batch, *x.shape[1:])


def _as_onehot(bank: dict) -> dict:
    return {
        path: ad.replace(
            kind=OneHotBank(
                **{f.name: getattr(ad.kind, f.name) for f in dataclasses.fields(ad.kind)}
            )
        )
        for path, ad in bank.items()
    }


def decode_timings(args, model, variables, sets, tokens) -> tuple[dict, dict]:
    """Greedy decoding of the ``N`` rows four ways (mixed, base, single, onehot), interleaved."""
    k = args.decode_adapters
    bank = adapters.stack_adapters(sets[:k])
    ids = jnp.arange(tokens.shape[0], dtype=jnp.int32) % k
    adapted = adapters.adapt(model.apply)

    def with_bank(state, *a, **kw):
        return adapted(state["base"], state["bank"], *a, adapter_ids=state["ids"], **kw)

    def with_set(state, *a, **kw):
        return adapted(state["base"], state["set"], *a, **kw)

    states = {
        "mixed": (with_bank, {"base": variables, "bank": bank, "ids": ids}),
        "base": (None, variables),
        "single": (with_set, {"base": variables, "set": sets[0]}),
        "onehot": (with_bank, {"base": variables, "bank": _as_onehot(bank), "ids": ids}),
    }

    def way(forward, state):
        return lambda: jax.block_until_ready(
            models.generate(model, state, tokens, max_new_tokens=args.new_tokens, forward=forward)
        )

    timings = common.run_rounds({name: way(*fs) for name, fs in states.items()}, rounds=args.rounds)
    out = {name: np.asarray(t.first_result) for name, t in timings.items()}
    return timings, out


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
    dec, dec_out = decode_timings(args, model, variables, sets, tokens)
    med = {name: t.median for name, t in dec.items()}
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
        "decode_adapters": args.decode_adapters,
        "decode_batch": n,
        "new_tokens": args.new_tokens,
        **{f"decode_{name}_s": t for name, t in med.items()},
        **{f"decode_{name}_tokens_per_s": n * args.new_tokens / t for name, t in med.items()},
        "mixed_vs_base_throughput": med["base"] / med["mixed"],
        "mixed_vs_single_throughput": med["single"] / med["mixed"],
        "mixed_vs_onehot_einsum": med["onehot"] / med["mixed"],
        "decode_mixed_equals_onehot": bool(np.array_equal(dec_out["mixed"], dec_out["onehot"])),
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
    print(
        common.markdown_table(
            ["greedy decoding", "median s", "tokens/s", "mixed / this"],
            [
                [
                    name,
                    f"{row[f'decode_{name}_s']:.4f}",
                    f"{row[f'decode_{name}_tokens_per_s']:.1f}",
                    f"{row[f'decode_{name}_s'] / row['decode_mixed_s']:.3f}",
                ]
                for name in ("mixed", "base", "single", "onehot")
            ],  # fmt: skip
        )
    )
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
