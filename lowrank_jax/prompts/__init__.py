"""Prompts for a frozen multimodal transformer under missing modalities (P13 SPR).

* :mod:`~lowrank_jax.prompts.backbone`: ``MultimodalTransformer`` (per-modality projections to
  tokens, pre-LN blocks; a missing modality enters as a blank (zero) input, or with
  ``missing_input="drop"`` leaves the attention keys; prompt slots handled by attention masks).
* :mod:`~lowrank_jax.prompts.missing`: missing patterns ``(b, M)`` bool, ``missing_type`` ids,
  ``sample_missing`` (MAP's missing-rate protocol).
* :mod:`~lowrank_jax.prompts.methods`: ``PromptMethod`` values — ``no_prompts`` (probe),
  ``map_prompts`` (MAP), ``modality_prompts`` (MSP), ``dcp_prompts`` (DCP-like), ``spr_prompts``
  (SPR, with ``gif``/``lfr``/``cfs`` ablations).
* :mod:`~lowrank_jax.prompts.training`: ``split_head``, ``init_trainable``, ``prompted_logits``,
  ``cross_entropy``, ``macro_f1``, ``count_params``.
"""

from lowrank_jax.prompts.backbone import MISSING_INPUTS, MultimodalTransformer
from lowrank_jax.prompts.methods import (
    PromptMethod,
    dcp_prompts,
    map_prompts,
    modality_prompts,
    no_prompts,
    spr_prompts,
)
from lowrank_jax.prompts.missing import (
    check_rate,
    missing_type,
    num_missing_types,
    sample_missing,
)
from lowrank_jax.prompts.training import (
    count_params,
    cross_entropy,
    init_trainable,
    macro_f1,
    prompted_logits,
    split_head,
)

__all__ = [
    "MISSING_INPUTS",
    "MultimodalTransformer",
    "PromptMethod",
    "check_rate",
    "count_params",
    "cross_entropy",
    "dcp_prompts",
    "init_trainable",
    "macro_f1",
    "map_prompts",
    "missing_type",
    "modality_prompts",
    "no_prompts",
    "num_missing_types",
    "prompted_logits",
    "sample_missing",
    "split_head",
    "spr_prompts",
]
