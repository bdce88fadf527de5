"""Adapters over any parameter pytree: target rules, LoRA, factorised application, merging, PEFT."""

from lowrank_jax.adapters.adapt import adapt
from lowrank_jax.adapters.core import (
    Adapter,
    AdapterSet,
    as_sets,
    combine,
    count_params,
    delta,
    init,
    merge,
    split_trainable,
    unmerge,
)
from lowrank_jax.adapters.dora import DoRA, dora, dora_column_norms, dora_norms, unmerge_dora
from lowrank_jax.adapters.finetune import classifier_sums, make_classifier_step, trained_parts
from lowrank_jax.adapters.fourierft import FourierFT, fourier_frequencies, fourierft
from lowrank_jax.adapters.frameft import FrameFT, frame_positions, frameft
from lowrank_jax.adapters.initializers import (
    eva,
    lora_da,
    lora_ga,
    lora_one,
    pissa,
)
from lowrank_jax.adapters.kfac import KFACStats, kfac_statistics
from lowrank_jax.adapters.kinds import AdapterKind, LoRA, lora
from lowrank_jax.adapters.mixed import AdapterBank, select_adapters, stack_adapters
from lowrank_jax.adapters.paths import match_rules, named_leaves
from lowrank_jax.adapters.peft import load_peft, save_peft
from lowrank_jax.adapters.quant import (
    BASE_DTYPES,
    dequantize,
    dequantize_base,
    low_precision_base,
    quantize_int8,
    quantize_nf4,
)
from lowrank_jax.adapters.sharding import partition_specs, shardings
from lowrank_jax.adapters.spectral import Spectral, random_stiefel, spectral
from lowrank_jax.adapters.vera import VeRA, vera, vera_projections

__all__ = [
    "BASE_DTYPES",
    "Adapter",
    "AdapterBank",
    "AdapterKind",
    "AdapterSet",
    "DoRA",
    "FourierFT",
    "FrameFT",
    "KFACStats",
    "LoRA",
    "Spectral",
    "VeRA",
    "adapt",
    "as_sets",
    "classifier_sums",
    "combine",
    "count_params",
    "delta",
    "dequantize",
    "dequantize_base",
    "dora",
    "dora_column_norms",
    "dora_norms",
    "eva",
    "fourier_frequencies",
    "fourierft",
    "frame_positions",
    "frameft",
    "init",
    "kfac_statistics",
    "load_peft",
    "lora",
    "lora_da",
    "lora_ga",
    "lora_one",
    "low_precision_base",
    "make_classifier_step",
    "match_rules",
    "merge",
    "named_leaves",
    "partition_specs",
    "pissa",
    "quantize_int8",
    "quantize_nf4",
    "random_stiefel",
    "save_peft",
    "select_adapters",
    "shardings",
    "spectral",
    "split_trainable",
    "stack_adapters",
    "trained_parts",
    "unmerge",
    "unmerge_dora",
    "vera",
    "vera_projections",
]
