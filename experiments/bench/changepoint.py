r"""Benchmark: time per observation of the P17 low-rank scan at t = 1e3, 1e4, 1e5 vs the peers.

One ``p × L = 30 × 30`` Poisson stream (rank-2 intensity, 2 events per cell; observation ``t``
is row ``t mod 4096`` of a sampled block, since the cost does not depend on the values). For each
``t`` every detector is first advanced to ``t`` (untimed), then the next ``--steps`` observations
are timed, all methods interleaved in rounds (``experiments.bench.common.run_rounds``):

* ``lowrank``: :func:`lowrank_jax.changepoint.lowrank_scan`, the default (adaptive SVT window
  estimates, rank 2 in ``b``, at most 4 directions per window, ``J`` = the first of
  ``--num-scales``, default 8 as in the experiment, one subspace step), a
  ``lax.scan`` fed one observation per step (``chunk=1``, the online latency) and 16 per step
  (``chunk=16``, the same per-observation work batched); ``lowrank_J<j>``: the same at the other
  ``--num-scales`` (chunk 16; window sums are updated incrementally, so ``J`` costs ``2(J+1)``
  estimates per observation, not ``2^J`` observations);
* the profile of that scan, chunk 16 (``--profile``, default on): ``frobenius`` (the same window
  sums and 2(J+1) means per observation, no estimate: the floor of any such scan),
  ``lowrank_fixed`` (fixed rank 2: two products of every mean with a ``30 × 2`` basis) and
  ``lowrank`` (SVT: the same with 4 directions, Gram–Schmidt ``R`` and the thresholds), each
  with XLA's FLOP and byte counts per observation (``cost_analysis`` of one chunk's update);
* ``focus``: changepoint-online's FOCuS (Poisson, known pre-change rate) on the totals
  ``Σ Y_t`` — a 1-D stream, pure Python, ``O(log t)`` amortised; its totals are summed before
  the timing; ``focus_with_sum`` also sums the 900 cells of each observation inside it;
* ``ruptures_window``: ruptures' PELT with the Poisson cost
  (:func:`lowrank_jax.changepoint.peers.ruptures_poisson_cost`) re-run on the last ``--window``
  observations (900-dimensional) at every step; its cost does not grow with ``t`` but is large.

Command (the machine may be shared: compare ratios from one run, not wall times across runs)::

    python -m experiments.bench.changepoint
    python -m experiments.bench.changepoint --ts 1000 10000 --steps 512   # quicker

Prints a markdown table and, as the last line, JSON (ratios of median process CPU time per
observation, which other jobs disturb less than wall time) with ``per_step_growth`` (lowrank time per
observation at the largest t / at the smallest, chunk 16), ``per_step_growth_chunk1``,
``speedup_vs_focus`` (FOCuS time / lowrank chunk-16 time at the largest t),
``speedup_vs_focus_chunk1``, ``speedup_vs_ruptures`` and ``profile`` (per variant: CPU µs,
FLOPs and bytes per observation at the largest t).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import common as bench
from lowrank_jax import changepoint as cp
from lowrank_jax.changepoint import peers, synthetic

BLOCK = 4096


@functools.partial(jax.jit, static_argnums=(0, 3))
def _advance(detector, state, idx, chunk, source):
    def step(s, i):
        return detector.update(s, source[i])

    state, scores = jax.lax.scan(step, state, idx.reshape(-1, chunk))
    return state, scores.max()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ts", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--steps", type=int, default=1024, help="timed observations per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=64, help="ruptures window")
    ap.add_argument("--ruptures-steps", type=int, default=3)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument(
        "--num-scales",
        type=int,
        nargs="+",
        default=[8, 5],
        help="J of the low-rank scan (windows 1..2^J); the first is timed one at a time too",
    )
    args = ap.parse_args(argv)
    key = jax.random.key(0)
    lam = synthetic.lowrank_intensity(key, p=30, num_cells=30, rank=2, mean=2.0)
    block = synthetic.sample_streams(key, lam, num_streams=1, length=BLOCK)[0]
    source = jnp.asarray(block)
    totals = block.sum((1, 2)).astype(np.float64)
    main_j = args.num_scales[0]
    dets = {"lowrank": cp.lowrank_scan(lam, rank=2, num_scales=main_j)}
    for j in args.num_scales[1:]:
        dets[f"lowrank_J{j}"] = cp.lowrank_scan(lam, rank=2, num_scales=j)
    if args.profile:
        dets["lowrank_fixed"] = cp.lowrank_scan(lam, rank=2, num_scales=main_j, estimator="rank")
        dets["frobenius"] = cp.frobenius_scan(lam, num_scales=main_j)
    runs = [("lowrank", 1), *((name, 16) for name in dets)]  # (detector, chunk)
    cost = peers.ruptures_poisson_cost()
    from changepoint_online import Focus, Poisson

    methods, states = {}, {}
    focus = Focus(Poisson(lam=float(lam.sum())))
    done = 0
    for t in sorted(args.ts):
        start = t  # time observations t+1 .. t+steps
        # Advance every detector to `start` (untimed).
        for name, chunk in runs:
            det, tag = dets[name], (name, chunk)
            prev = states.get((tag, "state"), det.init())
            at = states.get((tag, "t"), 0)
            n_adv = start - at
            n_adv -= n_adv % chunk
            idx = jnp.arange(at, at + n_adv)
            st = _advance(det, prev, idx % BLOCK, chunk, source)[0] if n_adv else prev
            states[(tag, "state")], states[(tag, "t")] = st, at + n_adv
            timed = jnp.arange(at + n_adv, at + n_adv + args.steps) % BLOCK
            fn = functools.partial(_advance, det, st, timed, chunk, source)
            jax.block_until_ready(fn())  # compile
            methods[f"{name}_chunk{chunk}@{t}"] = (
                lambda fn=fn: jax.block_until_ready(fn()),
                args.steps,
            )
        for i in range(done, start):
            focus.update(totals[i % BLOCK])
        done = start
        copies = [copy.deepcopy(focus) for _ in range(args.rounds + 1)]

        def run_focus(copies=copies, start=start):
            f = copies.pop() if copies else copy.deepcopy(focus)
            for i in range(start, start + args.steps):
                f.update(totals[i % BLOCK])
                f.statistic()

        methods[f"focus@{t}"] = (run_focus, args.steps)
        sum_copies = [copy.deepcopy(focus) for _ in range(args.rounds + 1)]

        def run_focus_with_sum(copies=sum_copies, start=start):
            f = copies.pop() if copies else copy.deepcopy(focus)
            for i in range(start, start + args.steps):
                f.update(float(block[i % BLOCK].sum()))
                f.statistic()

        if args.profile:
            methods[f"focus_with_sum@{t}"] = (run_focus_with_sum, args.steps)

        def run_ruptures(start=start):
            import ruptures

            for i in range(start, start + args.ruptures_steps):
                rows = np.arange(i - args.window, i) % BLOCK
                algo = ruptures.Pelt(custom_cost=cost(), min_size=2).fit(
                    block[rows].reshape(args.window, -1)
                )
                algo.predict(pen=50.0)

        methods[f"ruptures_window@{t}"] = (run_ruptures, args.ruptures_steps)
    timings = bench.run_rounds({k: v[0] for k, v in methods.items()}, rounds=args.rounds, warmup=1)
    # Ratios from process CPU time (less sensitive than wall time to other jobs on a shared
    # machine; every method here runs on the calling thread or XLA's pool); wall time is shown too.
    per_obs = {k: timings[k].cpu_median / methods[k][1] for k in methods}
    wall = {k: timings[k].median / methods[k][1] for k in methods}
    rows = [[k, f"{per_obs[k] * 1e6:.1f}", f"{wall[k] * 1e6:.1f}"] for k in methods]
    print(
        bench.markdown_table(
            ["method@t", "CPU µs per observation (median)", "wall µs (median)"], rows
        )
    )
    lo, hi = min(args.ts), max(args.ts)
    out = {
        "per_step_growth": per_obs[f"lowrank_chunk16@{hi}"] / per_obs[f"lowrank_chunk16@{lo}"],
        "per_step_growth_chunk1": per_obs[f"lowrank_chunk1@{hi}"] / per_obs[f"lowrank_chunk1@{lo}"],
        "focus_growth": per_obs[f"focus@{hi}"] / per_obs[f"focus@{lo}"],
        "speedup_vs_focus": per_obs[f"focus@{hi}"] / per_obs[f"lowrank_chunk16@{hi}"],
        "speedup_vs_focus_chunk1": per_obs[f"focus@{hi}"] / per_obs[f"lowrank_chunk1@{hi}"],
        "speedup_vs_ruptures": per_obs[f"ruptures_window@{hi}"] / per_obs[f"lowrank_chunk16@{hi}"],
        "profile": _profile(dets, source, per_obs, hi) if args.profile else {},
        "cpu_us_per_obs": {k: round(v * 1e6, 2) for k, v in per_obs.items()},
        "wall_us_per_obs": {k: round(v * 1e6, 2) for k, v in wall.items()},
        "ts": args.ts,
        "num_scales": args.num_scales,
        "threads": bench.num_threads(),
    }
    print(json.dumps(out))
    return out


def _profile(dets, source, per_obs, t) -> dict:
    """Per variant at time ``t``: CPU µs, and XLA's FLOPs and bytes accessed per observation
    (``cost_analysis`` of one 16-observation update, outside ``scan``)."""
    out = {}
    for name, det in dets.items():
        compiled = jax.jit(det.update).lower(det.init(), source[:16]).compile()
        cost = compiled.cost_analysis()
        cost = (cost[0] if cost else {}) if isinstance(cost, list | tuple) else (cost or {})
        out[name] = {
            "cpu_us_per_obs": round(per_obs[f"{name}_chunk16@{t}"] * 1e6, 2),
            "flops_per_obs": round(float(cost.get("flops", float("nan"))) / 16),
            "bytes_per_obs": round(float(cost.get("bytes accessed", float("nan"))) / 16),
        }
    out["focus"] = {"cpu_us_per_obs": round(per_obs[f"focus@{t}"] * 1e6, 2)}
    out["focus_with_sum"] = {"cpu_us_per_obs": round(per_obs[f"focus_with_sum@{t}"] * 1e6, 2)}
    return out


if __name__ == "__main__":
    main()
