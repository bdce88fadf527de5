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
from lowrank_jax.adapters.kinds import AdapterKind, LoRA, lora
from lowrank_jax.adapters.paths import match_rules, named_leaves
from lowrank_jax.adapters.peft import load_peft, save_peft
from lowrank_jax.adapters.sharding import partition_specs, shardings

__all__ = [
    "Adapter",
    "AdapterKind",
    "AdapterSet",
    "FrameFT",
    "LoRA",
    "adapt",
    "as_sets",
    "combine",
    "count_params",
    "delta",
    "frame_positions",
    "frameft",
    "init",
    "load_peft",
    "lora",
    "match_rules",
    "merge",
    "named_leaves",
    "partition_specs",
    "save_peft",
    "shardings",
    "split_trainable",
    "unmerge",
]
