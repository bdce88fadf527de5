"""GIST selection (P11) in ``experiments/llm_sft.py``: keep the training rows that serve a target.

With ``select.fraction > 0`` the training rows are scored before fine-tuning by
``selection.gist_pipeline``: per-example gradients of the mean next-token loss with respect to
the initial adapter factors (``adapter.init``; with ``kaiming``'s ``B = 0`` only ``B`` has a
gradient, ``x Aᵀ`` times the output error) on the frozen base, one row per example (``data.pack``
of the example alone, cut to ``data.max_length``); the target's gradients (``select.target``, a
source as ``data.valid`` takes, or the validation rows when unset) give the top ``select.k``
right singular directions; a row's score is the cosine of its projected gradient with the
target's mean projection (one subtask). ``selection.select_top`` keeps the best
``ceil(select.fraction · N)`` rows, which are packed and fine-tuned on as the whole file would
be. No warm-up run precedes the scoring (the paper scores at a warm-up checkpoint; here the
initial adapters are that checkpoint).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from experiments.common.llm_sft_steps import make_forward
from lowrank_jax import data, selection
from lowrank_jax.data import text


def example_rows(examples: list, max_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """One packed row per example (cut to ``max_length``): ``{"tokens", ...}`` ``(N, max_length)``."""
    rows = [data.pack([e], max_length=max_length, pad_id=pad_id) for e in examples]
    return {k: np.concatenate([r[k][:1] for r in rows]) for k in rows[0]}


def make_example_loss(model: Any) -> Any:
    """``loss(adapters, base, example) -> scalar``: one example's mean next-token loss."""
    forward = make_forward(model)

    def loss(lora, base, example):
        batch = {k: v[None] for k, v in example.items()}
        total, count = text.next_token_loss(
            forward(lora, base, batch), batch["tokens"], batch["loss_mask"]
        )
        return total / jnp.maximum(count, 1.0)

    return loss


def select(
    config: Any, model: Any, lora: Any, base: Any, pool: list, target: list, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, scores)``: the kept rows of ``pool`` (best first) and every row's GIST score
    for ``target`` (lists of ``text.Example``)."""
    s, t = config.select, config.data.max_length
    rows = {k: jnp.asarray(v) for k, v in example_rows(pool, t, pad_id).items()}
    val = {k: jnp.asarray(v) for k, v in example_rows(target, t, pad_id).items()}
    k = min(s.k, len(target))
    scores = selection.gist_pipeline(
        make_example_loss(model),
        lora,
        base,
        rows,
        val,
        jnp.zeros(len(target), jnp.int32),
        num_subtasks=1,
        ks=(k,),
        chunk_size=s.chunk_size,
    )[k]
    scores = np.asarray(scores)
    return selection.select_top(scores, fraction=s.fraction), scores
