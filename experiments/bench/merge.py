"""Benchmark: Extra-Merge over N checkpoints of a MiniLM-sized tree vs one LAWA pass and a naive stack.

``python -m experiments.bench.merge`` writes N = 40 checkpoints of the real all-MiniLM-L6-v2
parameter tree (22.7M float32 parameters) perturbed along a late-training-like trajectory,
θ_i = θ_MiniLM + 1e-3·(i·d + ε_i) with a fixed random drift d and fresh noise ε_i, one ``.npz``
per checkpoint (91 MB each), and reads them back lazily (one checkpoint per ``__getitem__``, as
from disk in a real run). Each method runs in its own subprocess, so each one's peak resident
memory is its own:

* ``lawa``: ``merging.lawa`` over all N checkpoints (one pass, one accumulator);
* ``extra_merge``: ``merging.extra_merge(window=10)`` with the default α: pass 1 sketches the
  trajectory (k = 65,536), pass 2 accumulates θ(α) (two passes, O(P + N·k + N²) memory);
* ``naive``: stack all N flattened checkpoints into an (N, P) float32 matrix, its Gram matrix
  by BLAS (``X Xᵀ``; an SVD of the wide matrix itself would need another N·P of workspace),
  eigen-decomposition, and θ(α) = coefficients @ X (O(N·P) memory). It is skipped, with
  ``null`` in the JSON, when the machine's available memory is under 1.5× what it needs.

LAWA and Extra-Merge alternate for ``--rounds`` rounds (the median wall time of the merge call
counts; imports and process start do not). Reported: wall time, the process's peak RSS
(sampled during the merge), and the RSS rise during the merge in parameter copies (4·P bytes).
The last line printed is a JSON object with ``extra_merge_vs_lawa_time``, ``extra_merge_peak_rss_mb``,
``naive_peak_rss_mb`` and more. Targets (issue #12): Extra-Merge within 2× one LAWA pass, its
memory within 3 parameter copies.

Example::

    python -m experiments.bench.merge                 # N = 40, MiniLM-sized; a few minutes
    python -m experiments.bench.merge --tiny          # seconds (the test)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.bench import common

__all__ = ["NpzCheckpoints", "main"]

MB = 1 << 20


class NpzCheckpoints(Sequence):
    """A lazy sequence of ``{path: array}`` trees, item ``i`` read from ``<directory>/<i>.npz``."""

    def __init__(self, directory: str, num: int):
        self.directory, self.num = directory, num

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num))]
        if not -self.num <= i < self.num:
            raise IndexError(i)
        with np.load(os.path.join(self.directory, f"{i % self.num}.npz")) as f:
            return {k: f[k] for k in f.files}


def _base_tree(tiny: bool) -> dict[str, np.ndarray]:
    if tiny:
        rng = np.random.default_rng(0)
        shapes = {"embed": (300, 64), "layer/kernel": (64, 256), "layer/bias": (256,)}
        return {k: rng.normal(size=s).astype(np.float32) * 0.05 for k, s in shapes.items()}
    from lowrank_jax import adapters, models

    _, variables, _ = models.load_minilm()
    named = adapters.paths.named_leaves(variables)
    return {k: np.asarray(v, np.float32) for k, v in named.items()}


def write_checkpoints(directory: str, num: int, *, tiny: bool) -> int:
    """Writes θ_0 … θ_{N-1} as ``<i>.npz``; returns the parameter count P."""
    base = _base_tree(tiny)
    drift = {
        k: np.random.default_rng([1, j]).standard_normal(v.shape, np.float32)
        for j, (k, v) in enumerate(base.items())
    }
    for i in range(num):
        tree = {
            k: v + 1e-3 * (i * drift[k] + rng.standard_normal(v.shape, np.float32))
            for j, (k, v) in enumerate(base.items())
            for rng in [np.random.default_rng([2, i, j])]
        }
        np.savez(os.path.join(directory, f"{i}.npz"), **tree)
    return int(sum(v.size for v in base.values()))


def _naive(ckpts: NpzCheckpoints, window: int) -> tuple[dict[str, np.ndarray], float]:
    """Stack all N, Gram by BLAS, eigen-decomposition, θ(α) = coefficients @ X (in memory)."""
    from lowrank_jax import merging
    from lowrank_jax.merging.extrapolation import extrapolation_weights

    first = ckpts[0]
    names = list(first)
    sizes = [first[k].size for k in names]
    x = np.empty((len(ckpts), sum(sizes)), np.float32)
    for i in range(len(ckpts)):
        tree = first if i == 0 else ckpts[i]
        x[i] = np.concatenate([tree[k].ravel() for k in names])
    del first, tree
    x -= x[0].copy()  # differences to θ_1: the same Gram, well conditioned
    gram = (x @ x.T).astype(np.float64)
    pca = merging.trajectory_pca(gram, window=window)
    coef = extrapolation_weights(pca, merging.default_alpha(window)).astype(np.float32)
    flat = coef @ x  # Σ coef = 1, so θ(α) = θ_1 + Σ_i coef_i (θ_i − θ_1)
    theta1 = ckpts[0]
    out, start = {}, 0
    for k, s in zip(names, sizes, strict=True):
        out[k] = (flat[start : start + s].reshape(theta1[k].shape) + theta1[k]).astype(np.float32)
        start += s
    return out, pca.rho1


def _child(method: str, directory: str, num: int, window: int) -> dict[str, Any]:
    """Runs one method in this (fresh) process and returns its measurements."""
    import jax

    from lowrank_jax import merging

    ckpts = NpzCheckpoints(directory, num)
    # Start the XLA backend before measuring: its fixed ~60 MB are no parameter copies.
    jax.block_until_ready(jax.numpy.zeros(8) + 1)
    rss = common.PeakRSS()
    t0 = time.perf_counter()
    with rss:
        if method == "lawa":
            out, rho1 = merging.lawa(ckpts), None
        elif method == "extra_merge":
            res = merging.extra_merge(ckpts, window=window, key=jax.random.key(0))
            out, rho1 = res.params, res.pca.rho1
        else:
            out, rho1 = _naive(ckpts, window)
        out = jax.tree.map(np.asarray, out)
    seconds = time.perf_counter() - t0
    p = sum(v.size for v in out.values())
    return {
        "method": method,
        "seconds": seconds,
        # the sampled peak during the merge: ru_maxrss would also count the parent's RSS at fork
        # (Linux keeps the high-water mark across execve)
        "peak_rss_mb": rss.peak / MB,
        "rss_before_mb": rss.start / MB,
        "rss_rise_copies": rss.rise / (4 * p),
        "rho1": rho1,
        "fingerprint": {k: float(np.sum(v, dtype=np.float64)) for k, v in sorted(out.items())},
    }


def _spawn(method: str, directory: str, num: int, window: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "experiments.bench.merge", "--_child", method]
    cmd += ["--_dir", directory, "--num_checkpoints", str(num), "--window", str(window)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num_checkpoints", type=int, default=40)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a tiny tree (tests)")
    p.add_argument("--no_naive", action="store_true", help="skip the naive stack (O(N·P) memory)")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        out = _child(args._child, args._dir, args.num_checkpoints, args.window)
        print(json.dumps(out))
        return out

    directory = args.workdir or tempfile.mkdtemp(prefix="bench_merge_")
    os.makedirs(directory, exist_ok=True)
    try:
        t0 = time.perf_counter()
        num_params = write_checkpoints(directory, args.num_checkpoints, tiny=args.tiny)
        print(
            f"wrote {args.num_checkpoints} checkpoints of {num_params:,} parameters "
            f"({4 * num_params / MB:.0f} MB each) in {time.perf_counter() - t0:.0f} s"
        )
        runs: dict[str, list[dict[str, Any]]] = {"lawa": [], "extra_merge": []}
        for r in range(args.rounds):
            for method in ("lawa", "extra_merge")[:: 1 if r % 2 == 0 else -1]:
                runs[method].append(_spawn(method, directory, args.num_checkpoints, args.window))
        need = 1.5 * 4 * num_params * (args.num_checkpoints + 2)
        naive = None
        if args.no_naive:
            print("naive skipped (--no_naive)")
        elif _mem_available() > need:
            naive = _spawn("naive", directory, args.num_checkpoints, args.window)
        else:
            print(f"naive skipped: needs ~{need / MB:.0f} MB, {_mem_available() / MB:.0f} MB free")
    finally:
        if args.workdir is None:
            shutil.rmtree(directory, ignore_errors=True)

    med = {m: float(np.median([x["seconds"] for x in v])) for m, v in runs.items()}
    rows = []
    for m, v in [*runs.items(), *([("naive", [naive])] if naive else [])]:
        rows.append(
            [
                m,
                f"{np.median([x['seconds'] for x in v]):.2f}",
                f"{max(x['peak_rss_mb'] for x in v):.0f}",
                f"{max(x['rss_rise_copies'] for x in v):.2f}",
                "" if v[0]["rho1"] is None else f"{v[0]['rho1']:.4f}",
            ]
        )
    print(
        common.markdown_table(
            ["method", "median s", "peak RSS MB", "RSS rise (param copies)", "ρ₁ (W)"], rows
        )
    )
    em = runs["extra_merge"][0]
    headline = {
        "num_checkpoints": args.num_checkpoints,
        "num_params": num_params,
        "param_copy_mb": round(4 * num_params / MB, 1),
        "window": args.window,
        "extra_merge_vs_lawa_time": round(med["extra_merge"] / med["lawa"], 3),
        "extra_merge_peak_rss_mb": round(max(x["peak_rss_mb"] for x in runs["extra_merge"]), 1),
        "lawa_peak_rss_mb": round(max(x["peak_rss_mb"] for x in runs["lawa"]), 1),
        "naive_peak_rss_mb": None if naive is None else round(naive["peak_rss_mb"], 1),
        "extra_merge_rss_rise_copies": round(
            max(x["rss_rise_copies"] for x in runs["extra_merge"]), 2
        ),
        "lawa_rss_rise_copies": round(max(x["rss_rise_copies"] for x in runs["lawa"]), 2),
        "naive_rss_rise_copies": None if naive is None else round(naive["rss_rise_copies"], 2),
        "extra_merge_rho1": em["rho1"],
        "naive_rho1": None if naive is None else naive["rho1"],
        "max_rel_fingerprint_diff_vs_naive": None
        if naive is None
        else max(
            abs(em["fingerprint"][k] - naive["fingerprint"][k])
            / max(abs(naive["fingerprint"][k]), 1e-12)
            for k in naive["fingerprint"]
        ),
    }
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    main()
