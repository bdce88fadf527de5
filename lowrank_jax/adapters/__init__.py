"""Adapters over any parameter pytree: target rules, LoRA, factorised application, folding, PEFT."""

from lowrank_jax.adapters.adapt import adapt
from lowrank_jax.adapters.core import (
    Adapter,
    AdapterSet,
    combine,
    count_params,
    delta,
    fold,
    init,
    split_trainable,
    unfold,
)
from lowrank_jax.adapters.dora import DoRA, dora, dora_norms, unfold_dora
from lowrank_jax.adapters.fourierft import FourierFT, fourierft
from lowrank_jax.adapters.frameft import FrameFT, frameft
from lowrank_jax.adapters.initializers import eva, lora_da, lora_ga, lora_one
from lowrank_jax.adapters.kinds import AdapterKind, LoRA, lora
from lowrank_jax.adapters.mixed import stack_adapters
from lowrank_jax.adapters.peft import load_peft, save_peft
from lowrank_jax.adapters.quant import low_precision_base
from lowrank_jax.adapters.sharding import partition_specs, shardings
from lowrank_jax.adapters.singular import Spectral, spectral
from lowrank_jax.adapters.vera import VeRA, vera

__all__ = [
    "Adapter",
    "AdapterKind",
    "AdapterSet",
    "DoRA",
    "FourierFT",
    "FrameFT",
    "LoRA",
    "Spectral",
    "VeRA",
    "adapt",
    "combine",
    "count_params",
    "delta",
    "dora",
    "dora_norms",
    "eva",
    "fold",
    "fourierft",
    "frameft",
    "init",
    "load_peft",
    "lora",
    "lora_da",
    "lora_ga",
    "lora_one",
    "low_precision_base",
    "partition_specs",
    "save_peft",
    "shardings",
    "spectral",
    "split_trainable",
    "stack_adapters",
    "unfold",
    "unfold_dora",
    "vera",
]
