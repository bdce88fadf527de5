"""lowrank_jax.spectral: power iteration, randomised SVD, FP8 scales."""

from lowrank_jax.spectral.fp8 import (
    FP8_FORMATS,
    DelayedScalingState,
    attention_fp8_scales,
    chernoff_gamma,
    current_scale,
    fp8_dtype,
    fp8_max,
    fp8_overflow_count,
    fp8_quantize_dequantize,
    geometry_aware_scale,
    init_delayed_scaling,
    logit_bound,
    norm_gain_bound,
    rank_agnostic_alpha,
    rank_agnostic_scale,
    rank_agnostic_tail_bound,
    rank_aware_alpha,
    rank_aware_tail_bound,
    rank_aware_tightness,
    update_delayed_scaling,
    worst_case_logit_bound,
)
from lowrank_jax.spectral.power_iteration import (
    PowerIterationState,
    attention_group_power_iteration,
    attention_power_iteration,
    init_attention_power_iteration,
    init_power_iteration,
    product_power_iteration,
)
from lowrank_jax.spectral.randomized_svd import randomized_svd

__all__ = [
    # fp8
    "FP8_FORMATS",
    "DelayedScalingState",
    "attention_fp8_scales",
    "chernoff_gamma",
    "current_scale",
    "fp8_dtype",
    "fp8_max",
    "fp8_overflow_count",
    "fp8_quantize_dequantize",
    "geometry_aware_scale",
    "init_delayed_scaling",
    "logit_bound",
    "norm_gain_bound",
    "rank_agnostic_alpha",
    "rank_agnostic_scale",
    "rank_agnostic_tail_bound",
    "rank_aware_alpha",
    "rank_aware_tail_bound",
    "rank_aware_tightness",
    "update_delayed_scaling",
    "worst_case_logit_bound",
    # power iteration
    "PowerIterationState",
    "attention_group_power_iteration",
    "attention_power_iteration",
    "init_attention_power_iteration",
    "init_power_iteration",
    "product_power_iteration",
    # randomised SVD
    "randomized_svd",
]
