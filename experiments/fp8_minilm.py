"""FP8 attention scales of the pretrained MiniLM against its max logit on Shakespeare (P14).

The scales of P14 come from the weights only; their bound assumes isotropic tokens, which real
text is not. This check computes, per layer of all-MiniLM-L6-v2, ``σ_max(W̃^Q_h W̃^{K⊤}_h)`` of the
bias-folded weights, the rank-aware / rank-agnostic / worst-case bounds and the FP8 scale
(``lowrank_jax.fp8.diagnostics.attention_logit_report``), next to the empirical max |logit| over the
valid token pairs of ``config.data.num_passages`` passages. No training. Writes ``config.json``,
``results.md`` and ``results.json``.

References: P14, arXiv 2602.18851 (reconstruction, see ``lowrank_jax.fp8``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from lowrank_jax import fp8, models
from lowrank_jax.fp8.bounds import norm_gain_bound
from lowrank_jax.fp8.diagnostics import attention_logit_report
from lowrank_jax.models import bert


def minilm_scales(config) -> list[dict[str, Any]]:
    """Per-layer geometry-aware scales of the pretrained MiniLM vs its max logit on Shakespeare.

    ``fp8.diagnostics.attention_logit_report`` folds BERT's q/k biases into the weights; ``g`` is
    the gain of the LayerNorm feeding each layer (post-LN: the embedding LayerNorm for layer 0, the
    previous layer's output LayerNorm after). Real tokens are not isotropic, so the rank-aware bound
    is not guaranteed here: the table shows how it fares.
    """
    from lowrank_jax import data

    mcfg, variables, tokenizer = models.load_minilm()
    m = config.data
    ds = data.load_shakespeare(
        passage_chars=m.passage_chars,
        max_passages_per_play=-(-m.num_passages // 35),
        seed=config.seed,
    )
    idx = np.random.default_rng(config.seed).choice(
        len(ds.x), min(m.num_passages, len(ds.x)), False
    )
    batch = models.tokenize(tokenizer, [str(ds.x[i]) for i in idx], max_len=m.max_len)
    ids, am = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    h, r = mcfg.num_attention_heads, fp8.fp8_max(config.policy.fmt)
    heads = lambda a: a.reshape(*a.shape[:-1], h, a.shape[-1] // h)
    rows = []
    for i, (x, ln, attn) in enumerate(bert.attention_inputs(mcfg, variables, ids, am)):
        q, k = attn["query"], attn["key"]
        gain = norm_gain_bound(ln["scale"], ln["bias"])
        report = _report(config, int((am > 0).sum(axis=1).max()))
        rep = report(
            x, heads(q["kernel"]), heads(k["kernel"]), b_q=heads(q["bias"]), b_k=heads(k["bias"]),
            mask=am > 0, key=jax.random.key(i), norm_gain=gain,
        )  # fmt: skip
        rows.append(
            {
                "layer": i,
                "g": float(gain),
                "max σ": float(rep.sigma.max()),
                "max abs(S) (text)": float(rep.max_logit.max()),
                "rank-aware bound": float(rep.rank_aware_bound.max()),
                "rank-agnostic bound": float(rep.rank_agnostic_bound.max()),
                "B_wc": float(rep.worst_case_bound.max()),
                "max_h abs(S)/bound (= utilisation)": float(
                    (rep.max_logit / rep.rank_aware_bound).max()
                ),
                "min scale": float(rep.scale.min()),
                "overflowing heads": int(jnp.sum(rep.max_logit * rep.scale > r)),
            }
        )
    return rows


def _report(config, seq_len: int):
    """``fp8.diagnostics.attention_logit_report`` with the config's settings (run eagerly by the
    study)."""
    p = config.policy
    rule = fp8.ScaleRule(seq_len=seq_len, delta=p.delta, fmt=p.fmt)
    return functools.partial(attention_logit_report, rule=rule, num_iters=p.power_iters)


def steps(config, mesh=None) -> list[common.Step]:
    """One layer's logit report as one jitted program, on abstract MiniLM activations (the study
    runs it eagerly, layer by layer)."""
    del mesh  # one device
    check_config(config)
    mcfg = models.BertConfig.from_json(models.minilm_dir() / "config.json")
    h, d, spec = mcfg.num_attention_heads, mcfg.hidden_size, jax.ShapeDtypeStruct
    b, t = config.data.num_passages, config.data.max_len
    w, bias = spec((d, h, d // h), jnp.float32), spec((h, d // h), jnp.float32)
    kwargs = {"b_q": bias, "b_k": bias, "mask": spec((b, t), jnp.bool_),
              "key": jax.eval_shape(lambda: jax.random.key(0)), "norm_gain": spec((), jnp.float32)}  # fmt: skip
    report = jax.jit(_report(config, t))
    return [common.Step("layer report", report, (spec((b, t, d), jnp.float32), w, w), kwargs)]


def check_config(config) -> None:
    """Validates the config before anything runs (raises ``common.ConfigError``)."""
    for path in ("data.num_passages", "data.passage_chars", "data.max_len", "policy.power_iters"):
        common.check_positive(config, path, integer=True)
    common.check_fraction(config, "policy.delta", allow_zero=False)
    common.check_choice(config, "policy.fmt", ("e4m3", "e5m2"))


def run(config, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Computes the per-layer table and writes the outputs."""
    del options  # no trainer of experiments.common runs here
    check_config(config)
    workdir = os.fspath(workdir)
    common.write_config_json(workdir, config)
    rows = minilm_scales(config)
    d = config.data
    notes = (
        f"all-MiniLM-L6-v2, {d.num_passages} Shakespeare passages of {d.passage_chars} characters "
        f"(≤ {d.max_len} tokens); q/k biases folded in; g = gain of the LayerNorm feeding each "
        f"layer; δ = {config.policy.delta:g}, γ auto, {config.policy.power_iters} power steps."
    )
    common.write_results_md(
        workdir, rows, title="Pretrained MiniLM: FP8 logit bounds vs max logit (P14)", notes=notes
    )
    ratio = "max_h abs(S)/bound (= utilisation)"
    result = {
        "max_ratio": max(r[ratio] for r in rows),
        "overflowing_heads": sum(r["overflowing heads"] for r in rows),
    }
    common.write_json(os.path.join(workdir, "results.json"), {"rows": rows, **result})
    return result
