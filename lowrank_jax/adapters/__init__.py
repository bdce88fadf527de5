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
from lowrank_jax.adapters.frameft import FrameFT, frame_positions, frameft
from lowrank_jax.adapters.initializers import (
    KFACStats,
    eva,
    kfac_statistics,
    lora_da,
    lora_ga,
    lora_one,
    pissa,
)
from lowrank_jax.adapters.kinds import AdapterKind, LoRA, lora
from lowrank_jax.adapters.paths import match_rules, named_leaves
from lowrank_jax.adapters.peft import load_peft, save_peft
from lowrank_jax.adapters.sharding import partition_specs, shardings

__all__ = [
    "Adapter",
    "AdapterKind",
    "AdapterSet",
    "FrameFT",
    "KFACStats",
    "LoRA",
    "adapt",
    "as_sets",
    "combine",
    "count_params",
    "delta",
    "eva",
    "frame_positions",
    "frameft",
    "init",
    "kfac_statistics",
    "load_peft",
    "lora",
    "lora_da",
    "lora_ga",
    "lora_one",
    "match_rules",
    "merge",
    "named_leaves",
    "partition_specs",
    "pissa",
    "save_peft",
    "shardings",
    "split_trainable",
    "unmerge",
]
