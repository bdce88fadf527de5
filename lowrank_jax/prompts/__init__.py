"""Prompts for a frozen multimodal transformer under missing modalities (P13 SPR).

* :mod:`~lowrank_jax.prompts.backbone`: ``MultimodalTransformer`` (per-modality projections to
  tokens, pre-LN blocks; a missing modality enters as a blank (zero) input, or with
  ``missing_input="drop"`` leaves the attention keys; prompt slots handled by attention masks).
* :mod:`~lowrank_jax.prompts.missing`: missing patterns ``(b, M)`` bool, ``missing_type`` ids,
  ``sample_missing`` (MAP's missing-rate protocol).
* :mod:`~lowrank_jax.prompts.methods`: ``PromptMethod`` values — ``no_prompts`` (probe),
  ``map_prompts`` (MAP), ``modality_prompts`` (MSP), ``dcp_prompts`` (DCP-like, with
  dynamic prompts generated from the input).
* :mod:`~lowrank_jax.prompts.spr`: ``spr_prompts`` (SPR, modules conditioned on the input, with
  ``gif``/``lfr``/``cfs`` ablations).
* :mod:`~lowrank_jax.prompts.training`: ``split_head``, ``init_trainable``, ``prompted_logits``,
  ``macro_f1``.
"""

from lowrank_jax.prompts.backbone import MultimodalTransformer
from lowrank_jax.prompts.missing import missing_type
from lowrank_jax.prompts.spr import spr_prompts

__all__ = [
    "MultimodalTransformer",
    "missing_type",
    "spr_prompts",
]
