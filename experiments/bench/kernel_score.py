r"""Benchmark: throughput and peak memory of the P7 kernel-score diffusion sampler.

The sampler's cost is one kernel-score (Tweedie denoiser) evaluation per reverse step,
``O(n·m·D)``: ``m`` samples against ``n`` training points in ``D`` dimensions. Two ways:

* **chunked**: :func:`lowrank_jax.generative.kernel_score.kernel_denoiser` with ``chunk_size``
  training points per block and a running log-sum-exp (memory ``O(m·(chunk + D))``);
* **unchunked**: one ``(m, n)`` logit matrix (memory ``O(m·n)``), run only where its estimated
  footprint is under ``--max-unchunked-mb``.

Training points are MNIST training images (``D = 784``, up to 60,000; random data otherwise).
By default one reverse step (a denoiser evaluation at a mid-trajectory time) is timed per method,
interleaved in rounds (``experiments.bench.common.run_rounds``), and the sampler's throughput is
**extrapolated** to ``--steps`` steps: ``samples/s = m / (steps · t_step)`` (the integrator's own
work is ``O(m·D)`` per step, negligible next to the score). ``--full`` instead runs the whole
sampler (``sample_kernel_diffusion``, ``--steps`` steps) once per method and reports the measured
time. Peak RSS is sampled while each method runs; the RSS rise is the part above what was
resident before it (the dataset, compiled code), i.e. the method's own working memory.

Command (the issue's size; ~minutes on a 2-core CPU per timed step, more when loaded)::

    python -m experiments.bench.kernel_score
    python -m experiments.bench.kernel_score --n 5000 --samples 500 --full   # a quick check

Prints a markdown table; the last line is a JSON with ``samples_per_s`` and ``peak_rss_mb`` (of
the chunked sampler) and the same for the unchunked one when it ran.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import common as bench
from lowrank_jax import generative as gen
from lowrank_jax.generative.kernel_score import kernel_denoiser

MB = 1 << 20


def _data(n: int, dim: int, seed: int) -> tuple[np.ndarray, str]:
    if dim == 784 and n <= 60_000:
        try:
            from lowrank_jax.data import load_mnist

            x = load_mnist("train").x.reshape(-1, 784)[:n]
            return np.asarray(x, np.float32), "MNIST train images"
        except (ImportError, FileNotFoundError):
            pass
    return np.random.default_rng(seed).random((n, dim), np.float32), "uniform random"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=60_000, help="training points")
    p.add_argument("--dim", type=int, default=784, help="ambient dimension D")
    p.add_argument("--samples", type=int, default=2_000, help="m, samples drawn")
    p.add_argument("--steps", type=int, default=100, help="reverse steps")
    p.add_argument("--k", type=int, default=4, help="intrinsic dimension (sets t0)")
    p.add_argument("--chunk", type=int, default=4096, help="training points per block")
    p.add_argument("--max-unchunked-mb", type=float, default=1500.0)
    p.add_argument("--rounds", type=int, default=1, help="timed rounds per method")
    p.add_argument("--full", action="store_true", help="run the whole sampler, no extrapolation")
    args = p.parse_args(argv)
    if min(args.n, args.dim, args.samples, args.steps, args.chunk, args.rounds) < 1:
        raise ValueError("--n, --dim, --samples, --steps, --chunk and --rounds must be positive")

    x, source = _data(args.n, args.dim, 0)
    data = jnp.asarray(x)
    m = args.samples
    # the unchunked step holds ~3 (m, n) float32 arrays (logits, exp, softmax) at once
    unchunked_mb = 3 * 4 * m * args.n / MB
    chunks = {"chunked": args.chunk}
    if unchunked_mb <= args.max_unchunked_mb:
        chunks["unchunked"] = None
    t_mid = jnp.float32(0.1)
    z = jax.random.normal(jax.random.key(1), (m, args.dim))

    def one(chunk):
        if args.full:
            return lambda: jax.block_until_ready(
                gen.sample_kernel_diffusion(
                    jax.random.key(0),
                    data,
                    num_samples=m,
                    k=args.k,
                    num_steps=args.steps,
                    chunk_size=chunk,
                )
            )
        # data is an argument, not a closed-over constant (XLA would constant-fold it)
        step = jax.jit(lambda y, x: kernel_denoiser(y, x, t_mid, chunk_size=chunk))
        return lambda: jax.block_until_ready(step(z, data))

    timings = bench.run_rounds({k: one(c) for k, c in chunks.items()}, rounds=args.rounds)
    rows, out = [], {}
    for name, t in timings.items():
        per_run = t.median
        total = per_run if args.full else per_run * args.steps
        sps = m / total
        rows.append([name, per_run, total, sps, t.peak_rss / MB, t.rss_rise / MB])
        prefix = "" if name == "chunked" else "unchunked_"
        out[f"{prefix}samples_per_s"] = sps
        out[f"{prefix}peak_rss_mb"] = t.peak_rss / MB
        out[f"{prefix}rss_rise_mb"] = t.rss_rise / MB
    if "unchunked" not in chunks:
        out["unchunked"] = f"skipped: ~{unchunked_mb:.0f} MB > --max-unchunked-mb"
    out.update(
        n=args.n,
        dim=args.dim,
        samples=m,
        steps=args.steps,
        chunk=args.chunk,
        extrapolated=not args.full,
        data=source,
        threads=bench.num_threads(),
    )
    label = "s per sampler run" if args.full else "s per step (timed)"
    print(
        f"Kernel-score sampler: n={args.n} training points ({source}), D={args.dim}, m={m}, "
        f"{args.steps} steps, chunk={args.chunk}, {bench.num_threads()} threads"
        + ("" if args.full else f"; throughput EXTRAPOLATED from one timed step x {args.steps}")
    )
    print(
        bench.markdown_table(
            [
                "method",
                label,
                f"s for {args.steps} steps",
                "samples/s",
                "peak RSS MB",
                "RSS rise MB",
            ],
            rows,
        )
    )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
