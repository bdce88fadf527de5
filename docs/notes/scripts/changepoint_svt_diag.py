"""P17 diagnostics of the SVT window estimates: the calibrated level ``c_τ``, and detection against it.

    python docs/notes/scripts/changepoint_svt_diag.py calibrate             # c_τ per ρ and n
    python docs/notes/scripts/changepoint_svt_diag.py detect 1.0 0.5 0.3    # detection per c_τ
    python docs/notes/scripts/changepoint_svt_diag.py ranks 1.0 0.5         # ranks SVT picks

What they diagnose (issue 31; the numbers are quoted on the P17 page, docs/papers/p17_changepoint.md,
and in ``lowrank_jax.changepoint.lowrank_scan``'s docstring). The setting is the default of
``configs/changepoint.py``: p = L = 30, rank 2, mean 2, σ = 0.2, J = 5 scales, T = 500, τ = 200,
α = 0.05.

* ``calibrate``: the statistic of ``calibrate_svt_scale`` computed by hand, per window: the 95%
  quantile of each window's largest singular deviation over its SVT threshold, on moving-block
  bootstrap streams (blocks of 10) of one training stretch per ρ ∈ {0, 0.5} and
  n ∈ {600, 3000, 12000}; then ``c_τ``, the quantile of the per-stream maximum.
* ``detect C...``: with a training stretch of 3000 (ρ = 0), the alarm threshold of each detector is
  the 95% quantile of the maxima on fresh null streams (no bootstrap); the share of changed
  streams (κ = 12, global and local change) detected after τ, for the fixed rank 2, the Frobenius
  scan and SVT at each ``c_τ``.
* ``ranks C...``: on one null stream, the share of t in (32, T] at which the window of 1 (and of
  32) is estimated with rank 0, 1, 2, ... by exact SVT at each ``c_τ`` (λ̄ = max of Λ).

Runtime on a loaded 2-core CPU: ``ranks`` about a minute, ``calibrate`` and ``detect`` some
minutes; ``--streams`` scales the number of streams down for a quick look.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout first

import jax
import numpy as np

from lowrank_jax import changepoint as cp
from lowrank_jax.changepoint import lowrank, synthetic
from lowrank_jax.changepoint.calibration import block_bootstrap_indices, quantile_threshold

P = NUM_CELLS = 30
NUM_SCALES, HORIZON, TAU = 5, 500, 200


def _intensity() -> jax.Array:
    return synthetic.lowrank_intensity(
        jax.random.key(0), p=P, num_cells=NUM_CELLS, rank=2, mean=2.0
    )


def calibrate(fraction: float = 1.0) -> None:
    """Prints the per-window 95% ratios and ``c_τ`` per ρ and training length n."""
    lam = _intensity()
    windows = 2 ** np.arange(NUM_SCALES + 1)
    num_streams = max(20, int(400 * fraction))
    for rho in (0.0, 0.5):
        for n in (600, 3000, 12000):
            train = synthetic.sample_streams(
                jax.random.key(1), lam, num_streams=1, length=n, sigma=0.2, rho=rho
            )[0]
            mean = train.mean(0)
            idx = np.asarray(
                block_bootstrap_indices(
                    jax.random.key(2), n, horizon=32, block_len=10, num_streams=num_streams
                )
            )
            streams = np.asarray(train)[idx].astype(np.float64)
            svt = lowrank.SVT(float(mean.max()), 0.05, 1.0)
            tau = np.asarray(
                lowrank.svt_threshold(
                    HORIZON,
                    windows.astype(float),
                    svt,
                    p=P,
                    num_cells=NUM_CELLS,
                    num_scales=NUM_SCALES,
                )
            )
            deviation = np.stack(
                [
                    np.linalg.svd(streams[:, -w:].mean(1) - np.asarray(mean), compute_uv=False)[
                        :, 0
                    ]
                    for w in windows
                ],
                1,
            )
            ratio = deviation / tau
            print(
                f"rho={rho} n={n} per-window 95% ratio "
                f"{np.round(np.quantile(ratio, 0.95, axis=0), 3)}"
                f" c_tau={quantile_threshold(ratio.max(1), 0.05):.3f}",
                flush=True,
            )


def detect(scales: list[float], fraction: float = 1.0) -> None:
    """Prints each detector's fresh-null threshold and the share of changed streams detected."""
    lam = _intensity()
    train = synthetic.sample_streams(jax.random.key(1), lam, num_streams=1, length=3000, sigma=0.2)[
        0
    ]
    mean = train.mean(0)
    null = synthetic.sample_streams(
        jax.random.key(2), lam, num_streams=max(20, int(200 * fraction)), length=HORIZON, sigma=0.2
    )
    changed = {}
    for kind in ("global", "local"):
        after = synthetic.change_intensity(
            lam, key=jax.random.key(5), kind=kind, kappa=12.0, block=10
        )
        changed[kind] = synthetic.sample_streams(
            jax.random.key(3),
            lam,
            num_streams=max(4, int(40 * fraction)),
            length=HORIZON,
            tau=TAU,
            lam_after=after,
            sigma=0.2,
        )

    def scores(detector, streams):
        b, t = streams.shape[:2]
        flat = streams.reshape(b * t, P, NUM_CELLS)
        index = np.arange(b * t).reshape(b, t)
        return np.asarray(cp.run_detector(detector, flat, index=index, chunk=16))

    detectors = {
        "fixed rank 2": cp.lowrank_scan(mean, rank=2, estimator="rank"),
        "Frobenius": cp.frobenius_scan(mean),
    }
    detectors.update({f"SVT c_tau={c}": cp.lowrank_scan(mean, rank=2, svt_scale=c) for c in scales})
    for name, detector in detectors.items():
        threshold = np.quantile(scores(detector, null).max(1), 0.95)
        found = [
            f"{kind}: detected {np.mean(cp.first_alarm(scores(detector, s), threshold) > TAU):.2f}"
            for kind, s in changed.items()
        ]
        print(name, f"threshold {threshold:.3f}", *found, flush=True)


def ranks(scales: list[float]) -> None:
    """Prints, per ``c_τ`` and window, the share of steps at which SVT keeps rank 0, 1, ..."""
    lam = _intensity()
    ys = synthetic.sample_streams(jax.random.key(1), lam, num_streams=1, length=HORIZON, sigma=0.2)
    ys = np.asarray(ys[0], np.float64)
    print("singular values of Lambda:", np.round(np.linalg.svd(lam, compute_uv=False)[:3], 1))
    for c in scales:
        svt = lowrank.SVT(float(lam.max()), 0.05, c)
        for w in (1, 32):
            chosen = []
            for t in range(33, HORIZON + 1):
                tau = float(
                    lowrank.svt_threshold(
                        t, w, svt, p=P, num_cells=NUM_CELLS, num_scales=NUM_SCALES
                    )
                )
                singular = np.linalg.svd(ys[t - w : t].mean(0), compute_uv=False)
                chosen.append(int((singular > tau).sum()))
            share = np.bincount(chosen) / len(chosen)
            print(f"c_tau={c} window {w}: share of t with rank 0, 1, ...: {np.round(share, 2)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("calibrate", "detect", "ranks"))
    parser.add_argument("scales", nargs="*", type=float, help="the c_τ values (detect, ranks)")
    parser.add_argument(
        "--streams", type=float, default=1.0, help="fraction of the streams (quick look: 0.1)"
    )
    args = parser.parse_args(argv)
    if args.what != "calibrate" and not args.scales:
        parser.error(f"{args.what} needs at least one c_τ value, e.g. 1.0 0.5")
    if args.what == "calibrate":
        calibrate(args.streams)
    elif args.what == "detect":
        detect(args.scales, args.streams)
    else:
        ranks(args.scales)


if __name__ == "__main__":
    main()
