"""lowrank_jax.fp8: FP8 scales for attention logits (P14), delayed scaling, FP8 emulation.

* :mod:`~lowrank_jax.fp8.bounds`: rank-aware / rank-agnostic logit bounds and the geometry-aware
  scale ``s = c R √d_h / (g² σ_max(W^Q W^{K⊤}) √(γ r log(2n²/δ)))`` (P14, reconstruction);
* :mod:`~lowrank_jax.fp8.sigma`: exact ``σ_max(W^Q_h W^{K⊤}_h)`` from the ``d_h × d_h`` core of
  thin QR factors (``O(d·d_h²)`` per head, GQA without key expansion) and the offline scales
  :func:`attention_scales` built on it (the default outside a training loop);
* :mod:`~lowrank_jax.fp8.scale_rule`: :class:`ScaleRule`, the knobs of the geometry-aware scale
  (``seq_len``, ``delta``, ``gamma``, ``rank_aware``, ``fmt``, ``calibration``), the one map from
  ``σ`` to per-head scales that every route uses;
* :mod:`~lowrank_jax.fp8.policies`: scaling policies as pure state machines
  (:class:`ScalingPolicy`: ``init``/``scales``/``observe``/``reset``) for a user's own loop:
  geometry-aware (warm-started power iteration), delayed scaling, current scaling;
* :mod:`~lowrank_jax.fp8.online`: :func:`online_calibration`, a factor learned from the observed
  ``amax`` over any policy;
* :mod:`~lowrank_jax.fp8.delayed`: Transformer Engine's delayed scaling and the current-scaling
  oracle;
* :mod:`~lowrank_jax.fp8.diagnostics`: the bounds of a (biased) attention layer next to its
  empirical max logit on real inputs;
* :mod:`~lowrank_jax.fp8.emulation`: E4M3/E5M2 formats, scaled quantise-dequantise, overflow
  counts.

Example (a user's own step; ``wq`` ``(L, d, H, d_h)``, ``wk`` ``(L, d, G, d_h)``, ``gains`` ``(L,)``)::

    rule = fp8.ScaleRule(seq_len=2048)
    policy = fp8.geometry_scaling_policy(rule)     # or fp8.online_calibration(...) of it
    pstate = policy.init(key, wq, wk, gains)
    scales, pstate = policy.scales(pstate, wq, wk, gains)   # (L, H), before the forward pass
    s_q = fp8.fp8_quantize_dequantize(logits, scales[layer][:, None, None])
"""

from lowrank_jax.fp8.bounds import (
    chernoff_gamma,
    logit_bound,
    rank_aware_tightness,
    worst_case_logit_bound,
)
from lowrank_jax.fp8.delayed import init_delayed_scaling, update_delayed_scaling
from lowrank_jax.fp8.emulation import fp8_max, fp8_quantize_dequantize
from lowrank_jax.fp8.online import online_calibration
from lowrank_jax.fp8.policies import ScalingPolicy, delayed_scaling_policy, geometry_scaling_policy
from lowrank_jax.fp8.scale_rule import ScaleRule
from lowrank_jax.fp8.sigma import attention_scales, attention_sigma_max

__all__ = [
    "ScaleRule",
    "ScalingPolicy",
    "attention_scales",
    "attention_sigma_max",
    "chernoff_gamma",
    "delayed_scaling_policy",
    "fp8_max",
    "fp8_quantize_dequantize",
    "geometry_scaling_policy",
    "init_delayed_scaling",
    "logit_bound",
    "online_calibration",
    "rank_aware_tightness",
    "update_delayed_scaling",
    "worst_case_logit_bound",
]
