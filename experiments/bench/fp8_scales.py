r"""Benchmark: exact and implicit ``σ_max(W^Q_h W^{K⊤}_h)`` for a Llama-2-70B-shaped stack (P14).

For every layer of an 80-layer attention stack with Llama-2-70B shapes (``d = 8192``, 64 query
heads, 8 key/value heads, ``d_h = 128``; random Gaussian weights, generated per layer from fixed
keys so that only one layer is in memory at a time) it computes the per-head
``σ_max(W^Q_h W^{K⊤}_{g(h)})`` (what the geometry-aware FP8 scale needs) by:

* **thin-QR core** (exact, :func:`lowrank_jax.fp8.attention_sigma_max`): ``σ_max(R_Q R_Kᵀ)`` of
  the ``d_h × d_h`` core of thin QR factors, ``O(d·d_h²)`` per head, keys factorised once per
  GQA group; all heads measured;
* **Gram + Cholesky** (exact): ``σ² = λ_max(L_Kᵀ (W_QᵀW_Q) L_K)`` with ``W_KᵀW_K = L_K L_Kᵀ``
  (Gram matrices accumulated by XLA in float32 at highest precision, the ``d_h × d_h`` problems in
  float64); all heads measured;
* **implicit** (:func:`lowrank_jax.spectral.attention_power_iteration`, then
  :meth:`lowrank_jax.fp8.ScaleRule.scales`) from a cold start
  (``--iters`` = 30 Golub–Kahan–Lanczos steps by default, ``--method power`` for plain power
  iteration; GQA without repeating keys) — not exact: its error is measured against the thin-QR σ;
  plus the cost of one warm-started power step, what a training step pays to *track* σ;
* **explicit**: form ``M = W^Q_h W^{K⊤}_g`` (``d×d``) and ``svd(M, compute_uv=False)``; at ~minutes
  per head on a CPU it is measured on ``--explicit-heads`` heads and **extrapolated** linearly to
  all ``80 × 64`` heads (the per-head cost does not depend on the layer).

Memory is XLA's compiled ``temp`` allocation of each route (``memory_analysis``) plus the process
peak RSS. The headline JSON compares the implicit route with the *fastest exact* one
(``speedup_vs_fastest_exact``; < 1 means the exact route is faster) and gives the implicit
route's ``max_rel_err`` against the thin-QR σ; the explicit SVD's extrapolated time is reported
but is not the baseline.

Command (the default is the full 80-layer stack; ``--layers 2`` for a quick check)::

    python -m experiments.bench.fp8_scales
    python -m experiments.bench.fp8_scales --layers 2 --explicit-heads 1

Prints a markdown table and, as the last line, a JSON of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax import fp8, spectral


def _weights(key, *, d: int, h: int, g: int, dh: int):
    kq, kk = jax.random.split(key)
    wq = jax.random.normal(kq, (d, h, dh), jnp.float32) / math.sqrt(d)
    wk = jax.random.normal(kk, (d, g, dh), jnp.float32) / math.sqrt(d)
    return wq, wk


def reference_sigma(wq, wk) -> np.ndarray:
    """Exact ``σ_max(W^Q_h W^{K⊤}_{g(h)})`` per head, ``O(d d_h²)``, no ``d×d`` matrix.

    ``σ_max(A Bᵀ)² = λ_max(Lᵀ (AᵀA) L)`` with ``BᵀB = L Lᵀ``: the ``d_h×d_h`` Gram matrices are
    accumulated by XLA in float32 at highest precision (relative error ~1e-6 for these shapes),
    the Cholesky factor and the eigenvalue problem are solved in float64.
    """
    d, h, dh = wq.shape
    g = wk.shape[1]
    hi = jax.lax.Precision.HIGHEST
    gram_q = np.asarray(jnp.einsum("dhk,dhl->hkl", wq, wq, precision=hi), np.float64)
    gram_k = np.asarray(jnp.einsum("dgk,dgl->gkl", wk, wk, precision=hi), np.float64)
    lk = np.repeat(np.linalg.cholesky(gram_k), h // g, axis=0)  # (H, d_h, d_h), small
    c = lk.transpose(0, 2, 1) @ gram_q @ lk
    return np.sqrt(np.linalg.eigvalsh(c)[:, -1])


def _compile(fn, *args):
    """Ahead-of-time compiled ``fn`` and its XLA temp allocation in bytes (-1 if unknown)."""
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    temp = int(getattr(analysis, "temp_size_in_bytes", -1)) if analysis is not None else -1
    return compiled, temp


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--d", type=int, default=8192)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=30, help="cold-start steps")
    p.add_argument("--method", choices=("lanczos", "power"), default="lanczos")
    p.add_argument("--explicit-heads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    d, h, g, dh, layers = a.d, a.heads, a.kv_heads, a.head_dim, a.layers
    key = jax.random.key(a.seed)
    gen = jax.jit(lambda k: _weights(k, d=d, h=h, g=g, dh=dh))

    rule = fp8.ScaleRule(seq_len=a.seq_len)

    def tracked(wq, wk, st, **kw):
        sigma, st = spectral.attention_power_iteration(wq, wk, st, **kw)
        return rule.scales(sigma, d=d, head_dim=dh), st

    def implicit(wq, wk, st):
        return tracked(wq, wk, st, num_iters=a.iters, method=a.method)

    def one_step(wq, wk, st):  # what a warm-started training step costs
        return tracked(wq, wk, st, num_iters=1)

    def thin_qr(wq, wk):
        return fp8.attention_sigma_max(wq, wk)

    def explicit(wq_h, wk_g):
        m = wq_h @ wk_g.T  # (d, d)
        return jnp.linalg.svd(m, compute_uv=False)[0]

    t_implicit = t_step = t_ref = t_qr = 0.0
    errors, sigmas, gram_vs_qr = [], [], []
    wq, wk = gen(jax.random.fold_in(key, 0))
    st0 = spectral.init_attention_power_iteration(jax.random.key(a.seed + 1), wq)
    implicit_jit, temp_implicit = _compile(implicit, wq, wk, st0)
    one_step_jit, temp_step = _compile(one_step, wq, wk, st0)
    explicit_jit, temp_explicit = _compile(explicit, wq[:, 0], wk[:, 0])
    qr_jit, temp_qr = _compile(thin_qr, wq, wk)
    t_start = time.perf_counter()
    for layer in range(layers):
        if layer:
            wq, wk = gen(jax.random.fold_in(key, layer))
        jax.block_until_ready(wq)
        st = spectral.init_attention_power_iteration(jax.random.fold_in(key, 10_000 + layer), wq)
        t = time.perf_counter()
        scales, st = implicit_jit(wq, wk, st)
        jax.block_until_ready(scales)
        t_implicit += time.perf_counter() - t
        t = time.perf_counter()
        jax.block_until_ready(one_step_jit(wq, wk, st))
        t_step += time.perf_counter() - t
        t = time.perf_counter()
        gram = reference_sigma(wq, wk)
        t_ref += time.perf_counter() - t
        t = time.perf_counter()
        ref = np.asarray(jax.block_until_ready(qr_jit(wq, wk)), np.float64)
        t_qr += time.perf_counter() - t
        est = np.asarray(st.sigma, np.float64)
        errors.append(np.abs(est - ref) / ref)
        gram_vs_qr.append(np.abs(gram - ref) / ref)
        sigmas.append(ref)
        if layer == 0:
            explicit_sig, explicit_err = [], []
            t = time.perf_counter()
            for head in range(a.explicit_heads):
                s = explicit_jit(wq[:, head], wk[:, head // (h // g)])
                explicit_sig.append(float(jax.block_until_ready(s)))
            t_explicit_measured = time.perf_counter() - t
            explicit_err = [abs(s - ref[i]) / ref[i] for i, s in enumerate(explicit_sig)]
        print(
            f"layer {layer + 1}/{layers}: implicit {t_implicit:.1f}s, max rel err "
            f"{max(e.max() for e in errors):.2e}, elapsed {time.perf_counter() - t_start:.0f}s",
            flush=True,
        )
    errors, gram_vs_qr = np.concatenate(errors), np.concatenate(gram_vs_qr)
    n_heads = layers * h
    t_explicit_per_head = t_explicit_measured / a.explicit_heads
    t_explicit_total = t_explicit_per_head * n_heads
    fastest_exact, t_exact = min(
        (("thin-QR core", t_qr), ("Gram + Cholesky", t_ref)), key=lambda x: x[1]
    )
    rows = [
        (
            f"implicit ({a.method}), cold start",
            f"{a.iters}",
            f"all {n_heads}",
            f"{t_implicit / n_heads * 1e3:.2f} ms",
            f"{t_implicit:.1f} s (measured)",
            f"{errors.max():.2e} (mean {errors.mean():.1e})",
            f"{temp_implicit / 2**20:.1f} MiB / layer",
        ),
        (
            "implicit, warm-started 1 power step",
            "1",
            f"all {n_heads}",
            f"{t_step / n_heads * 1e3:.3f} ms",
            f"{t_step:.2f} s (measured)",
            "tracks σ during training",
            f"{temp_step / 2**20:.1f} MiB / layer",
        ),
        (
            "exact: thin-QR core σ_max(R_Q R_Kᵀ)",
            "-",
            f"all {n_heads}",
            f"{t_qr / n_heads * 1e3:.2f} ms",
            f"{t_qr:.1f} s (measured)",
            "0 (reference)",
            f"{temp_qr / 2**20:.1f} MiB / layer",
        ),
        (
            "exact: Gram + Cholesky",
            "-",
            f"all {n_heads}",
            f"{t_ref / n_heads * 1e3:.2f} ms",
            f"{t_ref:.1f} s (measured)",
            f"{gram_vs_qr.max():.2e} vs thin-QR",
            "O(d·d_h) + d_h² per head",
        ),
        (
            "explicit svd(W_Q W_Kᵀ), d×d",
            "-",
            f"{a.explicit_heads} of {n_heads}",
            f"{t_explicit_per_head * 1e3:.0f} ms",
            f"{t_explicit_total:.0f} s (1 head measured, extrapolated ×{n_heads / a.explicit_heads:.0f})",
            f"{max(explicit_err):.2e}",
            f"{temp_explicit / 2**20:.1f} MiB / head",
        ),
    ]
    print()
    print(
        f"Llama-2-70B-shaped attention: {layers} layers × {h} q / {g} kv heads, d={d}, d_h={dh}, "
        f"float32, {jax.device_count()} {jax.devices()[0].platform} device(s)"
    )
    print()
    print(
        "| route | iterations | heads measured | time / head | total | max rel. error of σ | XLA temp memory |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    print(
        f"implicit vs the fastest exact route ({fastest_exact}): {t_exact / t_implicit:.2f}× "
        f"(> 1: implicit faster); peak RSS {_peak_rss_gb():.2f} GiB "
        f"(one layer's weights: {(d * h * dh + d * g * dh) * 4 / 2**30:.2f} GiB)"
    )
    headline = {
        "layers": layers,
        "heads": n_heads,
        "implicit_method": a.method,
        "implicit_iters": a.iters,
        "implicit_s": round(t_implicit, 3),
        "warm_step_s": round(t_step, 4),
        "thin_qr_s": round(t_qr, 3),
        "gram_cholesky_s": round(t_ref, 2),
        "fastest_exact": fastest_exact,
        "speedup_vs_fastest_exact": round(t_exact / t_implicit, 3),
        "gram_vs_qr_max_rel_diff": float(f"{gram_vs_qr.max():.3e}"),
        "explicit_s_per_head": round(t_explicit_per_head, 3),
        "explicit_s_extrapolated": round(t_explicit_total, 1),
        "explicit_heads_measured": a.explicit_heads,
        "speedup_vs_explicit_extrapolated": round(t_explicit_total / t_implicit, 1),
        "max_rel_err": float(f"{errors.max():.3e}"),
        "implicit_temp_mib_per_layer": round(temp_implicit / 2**20, 2),
        "explicit_temp_mib_per_head": round(temp_explicit / 2**20, 1),
        "thin_qr_temp_mib_per_layer": round(temp_qr / 2**20, 2),
        "peak_rss_gib": round(_peak_rss_gb(), 2),
    }
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    main()
