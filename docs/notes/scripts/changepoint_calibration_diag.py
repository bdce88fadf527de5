"""P17 diagnostics: why bootstrap-calibrated alarm thresholds missed the false-alarm rate α.

    python docs/notes/scripts/changepoint_calibration_diag.py bootstrap [--ns 600,3000] [--blocks 10]
        [--known_only] [--dets lowrank,frobenius,cusum_totals] [--stretches 1] [--reps 200]
    python docs/notes/scripts/changepoint_calibration_diag.py cusum [--n 600] [--R 40] [--fresh 2000]
    python docs/notes/scripts/changepoint_calibration_diag.py refit N CELL_MEAN   # e.g. 100 0.2
    python docs/notes/scripts/changepoint_calibration_diag.py windows

What they diagnose (issue 15 item 3; the findings and their tables are the appendix
docs/notes/p17_calibration.md, quoted in ``lowrank_jax/changepoint/calibration.py``). The setting
is the default of ``configs/changepoint.py`` (p = L = 30, rank 2, mean 2, J = 5 scales, chunk 16,
T = 500, ρ = 0) unless said otherwise; ``--sigma`` is the log-normal noise of the rates.

* ``bootstrap``: per training length n and block length, the 95% quantile of the null maxima that
  ``calibrate_threshold`` bootstraps from one training stretch against the same quantile on fresh
  null streams, and the false-alarm rate the bootstrap threshold gives on the fresh streams, with
  the detectors built from the true Λ or from the training stretch's mean.
* ``cusum``: the Poisson Page-CUSUM on the totals with its rate estimated on the training stretch
  (scalar streams in NumPy, checked against the library's ``totals_cusum`` first): false-alarm
  rates over ``--R`` training stretches of the in-sample bootstrap against the bootstrap that
  re-estimates the rate on each resampled stretch (what ``calibrate_threshold(refit=...)`` does).
* ``refit``: the same comparison through the library (``calibrate_threshold`` with and without
  ``refit``) on the unit tests' i.i.d. Poisson streams (p = 6, L = 5, rank 2; T = 100, α = 0.1,
  δ = 0.1), for a training length N and a mean count per cell CELL_MEAN.
* ``windows``: which window (1, 2, ..., 32) attains the low-rank scan's maximum on fresh null
  streams, for σ = 0 and 0.2.

Each takes minutes on a loaded 2-core CPU at its defaults (``bootstrap`` the longest); smaller
``--reps``, ``--R`` or ``--fresh`` give a quick look.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout first

import jax
import numpy as np

from lowrank_jax import changepoint as cp
from lowrank_jax.changepoint import lowrank, synthetic
from lowrank_jax.changepoint.calibration import quantile_threshold
from lowrank_jax.changepoint.detectors import totals_cusum
from lowrank_jax.changepoint.lowrank import initial_basis, lowrank_statistics

P = NUM_CELLS = 30
NUM_SCALES, HORIZON, ALPHA, CHUNK = 5, 500, 0.05, 16


def _intensity() -> jax.Array:
    return synthetic.lowrank_intensity(
        jax.random.key(0), p=P, num_cells=NUM_CELLS, rank=2, mean=2.0
    )


def cusum_max(x: np.ndarray, rate, delta: float) -> np.ndarray:
    """The two-sided Poisson Page-CUSUM's maximum over time, per row of ``x`` (B, T)."""
    rate = np.broadcast_to(np.asarray(rate, np.float64), x.shape[:1])
    up = down = top = np.zeros(x.shape[0])
    for t in range(x.shape[1]):
        up = np.maximum(0.0, up + x[:, t] * math.log1p(delta) - rate * delta)
        down = np.maximum(0.0, down + x[:, t] * math.log1p(-delta) + rate * delta)
        top = np.maximum(top, np.maximum(up, down))
    return top


def bootstrap(args: argparse.Namespace) -> None:
    """Bootstrap vs fresh-null quantiles and the resulting false-alarm rates (a markdown table)."""
    lam = _intensity()

    def detectors(mean):
        every = {
            "lowrank": cp.lowrank_scan(mean, rank=2, num_scales=NUM_SCALES, alpha=ALPHA),
            "frobenius": cp.frobenius_scan(mean, num_scales=NUM_SCALES, alpha=ALPHA),
            "cusum_totals": totals_cusum(mean.sum(), rel_change=0.05),
        }
        return {name: every[name] for name in args.dets.split(",")}

    def maxima(detector, ys, per_call=50):
        b, t = ys.shape[:2]
        flat = ys.reshape(b * t, P, NUM_CELLS)
        out = []
        for i in range(0, b, per_call):
            rows = min(per_call, b - i)
            index = np.arange(i * t, (i + rows) * t).reshape(rows, t)
            out.append(np.asarray(cp.run_detector(detector, flat, index=index, chunk=CHUNK).max(1)))
        return np.concatenate(out)

    start = time.time()
    fresh = synthetic.sample_streams(
        jax.random.key(7), lam, num_streams=args.reps, length=HORIZON, sigma=args.sigma
    )
    known = detectors(lam)
    fresh_max = {name: maxima(d, fresh) for name, d in known.items()}
    print(
        f"sigma={args.sigma} T={HORIZON} reps={args.reps}; fresh null maxima, detectors from the "
        "true λ: "
        + ", ".join(f"{k} q95={quantile_threshold(v, ALPHA):.3f}" for k, v in fresh_max.items()),
        flush=True,
    )
    print(
        "| n | block | detectors from | detector | boot q95 | fresh q95 "
        "| max of the bootstrap maxima | FA on fresh |"
    )
    for n in (int(x) for x in args.ns.split(",")):
        for rep in range(args.stretches):
            train = synthetic.sample_streams(
                jax.random.key(100 + n + 100000 * rep),
                lam,
                num_streams=1,
                length=n,
                sigma=args.sigma,
            )[0]
            sources = [("true λ", known)]
            if not args.known_only:
                sources.append(("train mean", detectors(train.mean(0))))
            for source, dets in sources:
                if source == "true λ":
                    fm = fresh_max
                else:
                    fm = {name: maxima(d, fresh) for name, d in dets.items()}
                for block in (int(x) for x in args.blocks.split(",")):
                    if source == "train mean" and block != 10:
                        continue
                    for name, d in dets.items():
                        cal = cp.calibrate_threshold(
                            d,
                            train,
                            key=jax.random.key(3),
                            alpha=ALPHA,
                            horizon=HORIZON,
                            block_len=block,
                            num_streams=args.reps,
                            chunk=CHUNK,
                        )
                        print(
                            f"| {n} | {block} | {source} | {name} | {cal.threshold:.3f} "
                            f"| {quantile_threshold(fm[name], ALPHA):.3f} "
                            f"| {cal.maxima.max():.3f} | {np.mean(fm[name] > cal.threshold):.3f} |",
                            flush=True,
                        )
    print(f"{time.time() - start:.0f} s")


def cusum(args: argparse.Namespace) -> None:
    """In-sample vs re-estimating bootstrap for the totals CUSUM with an estimated rate."""
    delta, block = 0.05, 10
    rng = np.random.default_rng(0)

    def totals(size):
        eps = args.sigma * rng.normal(size=size)
        return rng.poisson(args.mean_total * np.exp(eps - args.sigma**2 / 2)).astype(np.float64)

    def resample(n, length, num):
        starts = rng.integers(0, n - block + 1, (num, -(-length // block)))
        return (starts[:, :, None] + np.arange(block)).reshape(num, -1)[:, :length]

    x0 = totals((1, 64))
    detector = totals_cusum(args.mean_total, rel_change=delta)
    library = np.asarray(cp.run_detector(detector, x0[0].astype(np.int32)[:, None, None]))
    ours = cusum_max(x0, args.mean_total, delta)
    if not np.allclose(library.max(), ours, rtol=1e-4):
        raise RuntimeError(f"the NumPy CUSUM {ours} differs from the library's {library.max()}")
    known = cusum_max(totals((args.fresh, HORIZON)), args.mean_total, delta)
    print(
        f"sigma={args.sigma} n={args.n} R={args.R} B={args.B} fresh={args.fresh}; known rate: "
        f"fresh q95 = {quantile_threshold(known, ALPHA):.1f}"
    )
    rows = []
    for _ in range(args.R):
        train = totals(args.n)
        mu = train.mean()
        fresh = cusum_max(totals((args.fresh, HORIZON)), mu, delta)
        plain = cusum_max(train[resample(args.n, HORIZON, args.B)], mu, delta)
        mu_star = train[resample(args.n, args.n, args.B)].mean(1)
        reestimated = cusum_max(train[resample(args.n, HORIZON, args.B)], mu_star, delta)
        rows.append(
            [
                (mu - args.mean_total) / args.mean_total,
                np.mean(fresh > quantile_threshold(plain, ALPHA)),
                np.mean(fresh > quantile_threshold(reestimated, ALPHA)),
            ]
        )
    rows = np.array(rows)
    print(f"relative error of the rate: sd {rows[:, 0].std():.4f}")
    for j, name in ((1, "in-sample bootstrap"), (2, "re-estimating bootstrap")):
        fa = rows[:, j]
        q1, q2, q3 = np.quantile(fa, (0.25, 0.5, 0.75))
        print(
            f"{name}: false-alarm rate over {args.R} training stretches: mean {fa.mean():.3f} "
            f"(sd {fa.std():.3f}, quartiles {q1:.3f}/{q2:.3f}/{q3:.3f}, max {fa.max():.3f}); "
            f"corr with rate error {np.corrcoef(rows[:, 0], fa)[0, 1]:+.2f}"
        )


def refit(args: argparse.Namespace) -> None:
    """``calibrate_threshold`` with and without ``refit`` on small i.i.d. Poisson streams."""
    p, cells, rank = 6, 5, 2
    alpha, delta, horizon, reps, num_fresh = 0.1, 0.1, 100, 20, 200
    seeded = np.random.default_rng(0)
    lam = seeded.gamma(2.0, 1.0, (p, rank)) @ seeded.gamma(2.0, 1.0, (rank, cells))
    lam = lam * args.cell_mean / lam.mean()
    rng = np.random.default_rng(4)

    def refitted(stretch):
        return totals_cusum(stretch.sum((1, 2)).mean(), rel_change=delta)

    out = []
    for r in range(reps):
        train = rng.poisson(lam, (args.N, p, cells))
        detector = refitted(train)
        kwargs = dict(key=jax.random.key(r), alpha=alpha, horizon=horizon, chunk=10)
        with_refit = cp.calibrate_threshold(detector, train, refit=refitted, **kwargs)
        plain = cp.calibrate_threshold(detector, train, **kwargs)
        fresh = rng.poisson(lam.sum(), (num_fresh, horizon)).astype(np.float64)
        m = cusum_max(fresh, train.sum((1, 2)).mean(), delta)
        out.append([np.mean(m > with_refit.threshold), np.mean(m > plain.threshold)])
    out = np.array(out)
    print(
        f"N={args.N} cell mean {args.cell_mean}: false-alarm rate (refit, in-sample) "
        f"{np.round(out.mean(0), 3)} ± {np.round(out.std(0) / math.sqrt(reps), 3)} (SE)"
    )


def windows(args: argparse.Namespace) -> None:
    """The window attaining the low-rank scan's maximum on 30 fresh null streams per σ."""
    lam = _intensity()
    basis = initial_basis(lam, rank=2)
    bound = np.asarray(
        lowrank.lowrank_threshold(
            np.arange(1, HORIZON + 1),
            rate_bound=float(lam.max()),
            p=P,
            num_cells=NUM_CELLS,
            num_scales=NUM_SCALES,
            rank=2,
            alpha=ALPHA,
        )
    )
    for sigma in (0.0, 0.2):
        ys = synthetic.sample_streams(
            jax.random.key(7), lam, num_streams=30, length=HORIZON, sigma=sigma
        )
        wins, tops = np.zeros(NUM_SCALES + 1, int), []
        for y in ys:
            ratio = np.asarray(
                lowrank_statistics(y, basis, rank=2, num_scales=NUM_SCALES, chunk=CHUNK)
            )
            ratio = ratio / bound
            _, w = np.unravel_index(ratio.argmax(), ratio.shape)
            wins[w] += 1
            tops.append(ratio.max())
        print(
            f"sigma={sigma}: window attaining the max over 30 streams, w=1..32: "
            f"{wins.tolist()}; median max {np.median(tops):.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="what", required=True)
    boot = commands.add_parser("bootstrap", help=bootstrap.__doc__)
    boot.add_argument("--sigma", type=float, default=0.2)
    boot.add_argument("--ns", default="600,3000", help="training lengths, comma-separated")
    boot.add_argument("--reps", type=int, default=200, help="fresh and bootstrap streams")
    boot.add_argument("--blocks", default="10,1", help="block lengths, comma-separated")
    boot.add_argument("--known_only", action="store_true", help="only detectors from the true Λ")
    boot.add_argument("--stretches", type=int, default=1, help="training stretches per n")
    boot.add_argument("--dets", default="lowrank,frobenius,cusum_totals")
    cus = commands.add_parser("cusum", help=cusum.__doc__)
    cus.add_argument("--sigma", type=float, default=0.2)
    cus.add_argument("--n", type=int, default=600, help="training length")
    cus.add_argument("--R", type=int, default=40, help="training stretches")
    cus.add_argument("--B", type=int, default=200, help="bootstrap streams")
    cus.add_argument("--fresh", type=int, default=2000, help="fresh null streams")
    cus.add_argument("--mean_total", type=float, default=1800.0, help="p·L·2 events per step")
    ref = commands.add_parser("refit", help=refit.__doc__)
    ref.add_argument("N", type=int, help="training length")
    ref.add_argument("cell_mean", type=float, help="mean count per cell")
    commands.add_parser("windows", help=windows.__doc__)
    args = parser.parse_args(argv)
    {"bootstrap": bootstrap, "cusum": cusum, "refit": refit, "windows": windows}[args.what](args)


if __name__ == "__main__":
    main()
