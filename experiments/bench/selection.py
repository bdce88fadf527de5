r"""Benchmark: gradient features and scores of a data-selection pool, LESS vs GIST (P11).

Both methods compute factorised per-example LoRA gradients over the whole pool, chunk by chunk
(:func:`lowrank_jax.selection.gradient_features`); they differ in what they keep per example:

* **LESS** (Xia et al. 2024): at each of ``--checkpoints`` warm-up checkpoints, the Adam update
  direction of every pool gradient, JL-projected to ``--less-dim`` (8,192 in the paper), so
  ``4 · d · C`` bytes per example (:func:`~lowrank_jax.selection.less_pipeline`);
* **GIST**: at one checkpoint, the projection onto the top-``--gist-k`` right singular directions
  of the validation-gradient matrix, ``4 · k`` bytes per example
  (:func:`~lowrank_jax.selection.gist_pipeline`).

The model is the char-GPT of ``configs/gist.py`` (width 64, 2 blocks, LoRA rank 8 on the
attention projections: 8,192 factor parameters), untrained, with the LoRA ``B`` factors and the
Adam moments drawn at random so every gradient is non-zero (the cost does not depend on the
values). Pool and validation examples are real Shakespeare passages (64 characters + 1).
Each method runs once after an untimed warm-up run (compilation), alternating as in
:func:`experiments.bench.common.run_rounds`; peak RSS is sampled while it runs.

Command (the issue's size; minutes on a 2-core CPU)::

    python -m experiments.bench.selection
    python -m experiments.bench.selection --pool 512 --less-dim 512   # a quick check

Prints a markdown table; the last line is a JSON with ``gist_storage_ratio`` (GIST bytes / LESS
bytes per example) and ``gist_time_ratio`` (GIST seconds / LESS seconds), targets 0.01 and 0.25.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.bench import common as bench
from lowrank_jax import adapters, data, models, selection
from lowrank_jax.selection.pipeline import WarmupCheckpoint

MB = 1 << 20
TARGETS = r".*attention/(query|key|value|out)/kernel"


def _passages(num: int, seq_len: int) -> tuple[np.ndarray, int]:
    """``num`` encoded passages of ``seq_len + 1`` characters (repeated if the Folio runs out)."""
    ds = data.load_shakespeare(label="play", passage_chars=seq_len + 1)
    vocab = {ch: i for i, ch in enumerate(sorted(set("".join(ds.x))))}
    enc = np.asarray([[vocab[ch] for ch in s] for s in ds.x], np.int32)
    idx = np.random.default_rng(0).permutation(len(enc))
    return enc[np.resize(idx, num)], len(vocab)


def _problem(args):
    x, vocab = _passages(args.pool + args.val, args.seq_len)
    model = models.CharGPT(vocab, args.width, args.depth, 4, args.seq_len)
    variables = model.init(jax.random.key(0), jnp.asarray(x[:1, :-1]))
    ads = adapters.init(jax.random.key(1), variables, [(TARGETS, adapters.lora(args.rank))])
    leaves, treedef = jax.tree.flatten(ads)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    ads = jax.tree.unflatten(
        treedef,
        [a + 0.02 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)],
    )
    fwd = adapters.adapt(model.apply)

    def example_loss(ad, frozen, ex):
        logits = fwd(frozen, ad, ex["x"][None, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ex["x"][None, 1:]).mean()

    num_params = sum(a.size for a in jax.tree.leaves(ads))
    ckpts = []
    for c in range(args.checkpoints):
        km, kv = jax.random.split(jax.random.key(10 + c))
        mu = 1e-3 * jax.random.normal(km, (num_params,))
        nu = 1e-6 * (1.0 + jax.random.uniform(kv, (num_params,)))
        ckpts.append(WarmupCheckpoint(ads, mu, nu, 1.0 / args.checkpoints))
    pool = {"x": jnp.asarray(x[: args.pool])}
    val = {"x": jnp.asarray(x[args.pool :])}
    subtasks = jnp.arange(args.val) % args.subtasks
    return example_loss, variables, ckpts, pool, val, subtasks, num_params


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pool", type=int, default=20_000, help="pool examples scored")
    p.add_argument("--val", type=int, default=45, help="validation examples")
    p.add_argument("--subtasks", type=int, default=9, help="validation subtasks")
    p.add_argument("--less-dim", type=int, default=8192, help="LESS's JL dimension d")
    p.add_argument("--checkpoints", type=int, default=4, help="LESS's warm-up checkpoints C")
    p.add_argument("--gist-k", type=int, default=9, help="GIST's k")
    p.add_argument("--chunk", type=int, default=256, help="examples per gradient chunk")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args(argv)
    sizes = (args.pool, args.val, args.subtasks, args.less_dim, args.checkpoints, args.gist_k)
    if min(sizes + (args.chunk, args.seq_len, args.width, args.depth, args.rank)) < 1:
        raise ValueError("every size argument must be a positive integer")
    if args.gist_k > args.val or args.subtasks > args.val:
        raise ValueError(f"--gist-k and --subtasks must be <= --val ({args.val})")

    loss, frozen, ckpts, pool, val, subtasks, num_params = _problem(args)
    kw = dict(num_subtasks=args.subtasks, chunk_size=args.chunk)
    methods = {
        "LESS": lambda: jax.block_until_ready(
            selection.less_pipeline(
                loss,
                ckpts,
                frozen,
                pool,
                val,
                subtasks,
                key=jax.random.key(3),
                dim=args.less_dim,
                **kw,
            )
        ),
        "GIST": lambda: jax.block_until_ready(
            selection.gist_pipeline(
                loss, ckpts[-1].trainable, frozen, pool, val, subtasks, ks=(args.gist_k,), **kw
            )[args.gist_k]
        ),
    }
    stored = {
        "LESS": selection.feature_storage_bytes(
            dim=args.less_dim, num_checkpoints=args.checkpoints
        ),
        "GIST": selection.feature_storage_bytes(dim=args.gist_k),
    }
    timings = bench.run_rounds(methods, rounds=1)
    rows, out = [], {}
    for name, t in timings.items():
        rows.append(
            [name, t.median, t.cpu_median, args.pool / t.median, stored[name], t.peak_rss / MB]
        )
        key = name.lower()
        out.update(
            {
                f"{key}_examples_per_s": args.pool / t.median,
                f"{key}_cpu_s": t.cpu_median,
                f"{key}_bytes_per_example": stored[name],
                f"{key}_peak_rss_mb": t.peak_rss / MB,
            }
        )
    out["gist_storage_ratio"] = stored["GIST"] / stored["LESS"]
    out["gist_time_ratio"] = timings["GIST"].median / timings["LESS"].median
    out.update(pool=args.pool, factor_params=num_params, threads=bench.num_threads())
    print(
        f"Selection features: {args.pool} Shakespeare passages, char-GPT with {num_params} LoRA "
        f"factor parameters; LESS d={args.less_dim} x {args.checkpoints} checkpoints, "
        f"GIST k={args.gist_k}; {bench.num_threads()} threads"
    )
    header = ["method", "s (wall)", "s (CPU)", "examples/s", "bytes/example", "peak RSS MB"]
    print(bench.markdown_table(header, rows))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
