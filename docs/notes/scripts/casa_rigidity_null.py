"""A random-perturbation null for P18's spectral-rigidity diagnostic.

``docs/papers/p18_casa.md`` reports that full fine-tuning moved MiniLM's layer-5 kernels by 8.2%
(``‖W_t − W_s‖_F / ‖W_s‖_F``) but their singular spectra by 0.6% (``‖s_t − s_s‖ / ‖s_s‖``), a
``rigidity_ratio`` (spectrum drift / weight drift) of 0.078 (``merging.spectral_diagnostics``,
mean over the six adapted kernels). Is that small ratio a property of the fine-tuning, or would
any perturbation of the same size leave the spectrum about as still? This script adds to each of
the same six real kernels (layer 5 of the pretrained all-MiniLM-L6-v2: attention query / key /
value / out, 384 × 384; MLP fc1 384 × 1536, fc2 1536 × 384) an i.i.d. Gaussian perturbation
scaled to the same relative Frobenius norm (default 0.082) and computes the same three numbers
with the same formulas, over a few random draws. No training; NumPy SVDs only.

Command (about 10 s of CPU)::

    python docs/notes/scripts/casa_rigidity_null.py --out=/tmp/casa_rigidity_null.json

Prints, per kernel and as the mean over kernels (the statistic of the P18 table), the mean ± sd
over draws of ``weight_drift``, ``spectrum_drift`` and ``rigidity_ratio``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout first

import numpy as np

from lowrank_jax import models

KERNELS = r"layer_?5.*/(attention/(query|key|value|out)|mlp/(fc1|fc2))/kernel$"


def _kernels(variables) -> dict[str, np.ndarray]:
    flat = {}

    def walk(tree, path):
        if hasattr(tree, "items"):
            for k, v in tree.items():
                walk(v, f"{path}/{k}" if path else str(k))
        else:
            flat[path] = np.asarray(tree, np.float64)

    walk(variables["params"], "")
    return {p: w for p, w in flat.items() if re.search(KERNELS, p)}


def rigidity(w: np.ndarray, e: np.ndarray) -> dict[str, float]:
    """The three scalars of `merging.spectral_diagnostics` for `W_s = w`, `W_t = w + e`."""
    s_s = np.linalg.svd(w, compute_uv=False)
    s_t = np.linalg.svd(w + e, compute_uv=False)
    weight = np.linalg.norm(e) / np.linalg.norm(w)
    spectrum = np.linalg.norm(s_t - s_s) / np.linalg.norm(s_s)
    return {"weight_drift": weight, "spectrum_drift": spectrum, "rigidity_ratio": spectrum / weight}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drift", type=float, default=0.082, help="relative Frobenius norm of E")
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    _, variables, _ = models.load_minilm()
    kernels = _kernels(variables)
    if len(kernels) != 6:
        raise SystemExit(f"expected the 6 adapted layer-5 kernels, found {sorted(kernels)}")
    rng = np.random.default_rng(args.seed)
    per = {p: [] for p in kernels}
    for _ in range(args.draws):
        for p, w in kernels.items():
            e = rng.standard_normal(w.shape)
            e *= args.drift * np.linalg.norm(w) / np.linalg.norm(e)
            per[p].append(rigidity(w, e))
    keys = ("weight_drift", "spectrum_drift", "rigidity_ratio")
    out = {"drift": args.drift, "draws": args.draws, "seed": args.seed, "kernels": {}}
    for p, rows in per.items():
        out["kernels"][p] = {
            k: [float(np.mean([r[k] for r in rows])), float(np.std([r[k] for r in rows]))]
            for k in keys
        }
        print(p, {k: round(v[0], 4) for k, v in out["kernels"][p].items()})
    means = [
        {k: float(np.mean([per[p][i][k] for p in kernels])) for k in keys}
        for i in range(args.draws)
    ]
    out["mean_over_kernels"] = {
        k: [float(np.mean([m[k] for m in means])), float(np.std([m[k] for m in means]))]
        for k in keys
    }
    print(
        "mean over kernels (mean ± sd over draws):",
        {k: f"{v[0]:.4f} ± {v[1]:.4f}" for k, v in out["mean_over_kernels"].items()},
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
