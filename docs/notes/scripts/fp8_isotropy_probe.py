"""Which assumption of P14's rank-aware logit bound breaks on the trained fp8_attention model.

Trains the experiment's model in float32 (``configs/fp8_attention.py``, no transients) and, at a
few steps, compares each layer's empirical ``max|S|`` with the rank-aware bound ``B = α(δ) B_wc``
(``fp8.logit_bound``, γ auto) on one copy-task batch of 32 sequences, together with what the
bound assumes:

* ``ratio``: ``max|S| / B`` per head (> 1: the bound is exceeded);
* ``ratio_rotated``: the same tokens rotated by one Haar-random orthogonal matrix (same norms,
  isotropic directions with respect to ``M = W^Q W^{K⊤}``), same weights;
* ``ratio_centred``: the tokens minus their mean (the LayerNorm bias / mean-token term removed);
  ``mean_term``: ``|μᵀ M_h μ|/√d_h`` of the mean token ``μ`` over ``B``;
* ``norm_factor``: ``(max‖x‖ / (g√d))²`` (≤ 1: the norm assumption ``‖x‖ ≤ g√d`` holds);
* ``energy_q`` / ``energy_k``: mean fraction of ``‖x‖²`` in the column space of ``W^Q_h`` /
  ``W^K_h`` (isotropic tokens: ``d_h/d``);
* ``stable_rank``: ``‖M_h‖_F² / σ_max²`` (γ auto covers every spectrum of rank ≤ d_h).

Command (about 5 min on a loaded 2-core CPU; ``--smoke``: the smoke config)::

    python docs/notes/scripts/fp8_isotropy_probe.py --out=/tmp/fp8_probe.json

Results and reading: ``docs/notes/p14_fp8.md`` ("Why trained attention exceeds the rank-aware bound").
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout first

import jax
import jax.numpy as jnp
import numpy as np

from configs import fp8_attention as fp8_config
from experiments import fp8_attention as exp
from lowrank_jax import fp8
from lowrank_jax.models.fp8_transformer import fp8_attention_geometry


def probe(config, model, params, key) -> list[dict[str, jax.Array]]:
    """The per-layer statistics above for one batch (float32)."""
    num_layers, d = config.model.num_layers, config.model.d_model
    heads = config.model.num_heads
    dh, n = d // heads, config.data.seq_len - 1
    inputs, _, _ = exp.copy_batch(
        key, batch_size=32, seq_len=config.data.seq_len, vocab_size=config.data.vocab_size
    )
    _, inter = model.apply({"params": params}, inputs, None, capture_intermediates=True)
    wq, wk, gains = fp8_attention_geometry(params, num_layers=num_layers)
    bound = fp8.logit_bound(
        fp8.attention_sigma_max(wq, wk), d=d, head_dim=dh, seq_len=n,
        norm_gain=gains[:, None], delta=config.policy.delta,
    )  # fmt: skip
    mask = jnp.tril(jnp.ones((n, n), bool))
    rot = jnp.linalg.qr(jax.random.normal(jax.random.key(5), (d, d)))[0]
    out = []
    for i in range(num_layers):
        x = inter["intermediates"][f"block_{i}_ln_attention"]["__call__"][0]  # (b, n, d)

        def amax(t, i=i):
            q = jnp.einsum("bnd,dhk->bnhk", t, wq[i])
            k = jnp.einsum("bnd,dhk->bnhk", t, wk[i])
            s = jnp.einsum("bihk,bjhk->bhij", q, k) / math.sqrt(dh)
            return jnp.max(jnp.where(mask, jnp.abs(s), 0.0), axis=(0, 2, 3))

        mu = jnp.mean(x, axis=(0, 1))
        nrm = jnp.linalg.norm(x, axis=-1)

        def energy(w, x=x, nrm=nrm):
            basis = jnp.linalg.qr(w)[0]  # (d, d_h)
            return jnp.mean(jnp.sum((x @ basis) ** 2, -1) / nrm**2)

        m = jnp.einsum("dhk,ehk->hde", wq[i], wk[i])
        stats = {
            "ratio": amax(x) / bound[i],
            "ratio_rotated": amax(x @ rot) / bound[i],
            "ratio_centred": amax(x - mu) / bound[i],
            "mean_term": jnp.abs(jnp.einsum("d,hde,e->h", mu, m, mu)) / math.sqrt(dh) / bound[i],
            "norm_factor": (jnp.max(nrm) / (gains[i] * math.sqrt(d))) ** 2,
            "energy_q": jnp.stack([energy(wq[i][:, h]) for h in range(heads)]),
            "energy_k": jnp.stack([energy(wk[i][:, h]) for h in range(heads)]),
            "stable_rank": jnp.sum(m**2, axis=(1, 2)) / jnp.linalg.norm(m, ord=2, axis=(1, 2)) ** 2,
        }
        out.append(stats)
    return out


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    config = fp8_config.get_config("smoke" if args.smoke else None)
    steps = config.schedule.num_steps
    at = sorted({0, steps // 12, steps // 6, steps // 3, steps // 2, 2 * steps // 3, steps - 1})
    step, tx, policy = exp.make_train_step(exp.Policy("none", "none"), config, transients=False)
    model = exp.make_model(config, quantize=False)
    tokens = jnp.zeros((1, config.data.seq_len - 1), jnp.int32)
    params = model.init(jax.random.key(config.seed), tokens, None)["params"]
    geometry = fp8_attention_geometry(params, num_layers=config.model.num_layers)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0)}
    state["policy"] = policy.init(jax.random.key(0), *geometry)
    frozen = {"lr": jnp.asarray(exp.learning_rates(config, steps, spikes=False))}
    train = jax.jit(lambda s, k: step(s, frozen, None, k)[0])
    run_probe = jax.jit(lambda p: probe(config, model, p, jax.random.key(999)))
    key, rows = jax.random.key(123), []
    for t in range(steps):
        if t in at:
            for i, layer in enumerate(jax.device_get(run_probe(state["params"]))):
                layer = {
                    k: np.round(np.asarray(v, np.float64), 4).tolist() for k, v in layer.items()
                }
                rows.append({"step": t, "layer": i, **layer})
                print(json.dumps(rows[-1]), flush=True)
        key, sub = jax.random.split(key)
        state = dict(train(state, sub), step=jnp.int32(t + 1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    return rows


if __name__ == "__main__":
    main()
