"""Training a prompt method on a frozen ``MultimodalTransformer``: the trainable state, the
prompted forward (backbone behind ``stop_gradient``), the loss and macro-F1.

The trainable pytree is ``{"prompts": method params, "head": head params}``; the backbone
(everything but ``head``) is a separate, frozen argument. Gradients of ``prompted_logits`` with
respect to the backbone are exactly zero (``jax.lax.stop_gradient``), so a user who differentiates
the whole parameter tree by mistake still cannot move it.

Example::

    frozen, head = split_head(params)
    method = spr_prompts(num_modalities=2, num_layers=3, num_tokens=4, dim=64)
    trainable = init_trainable(key, method, head)
    logits = prompted_logits(model, frozen, trainable, method, feats, missing)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from lowrank_jax.prompts.methods import PromptMethod

__all__ = [
    "init_trainable",
    "macro_f1",
    "prompted_logits",
    "split_head",
]


def split_head(params: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """``(frozen backbone params, head params)`` of a ``MultimodalTransformer``'s ``params``.

    Raises:
      ValueError: if ``params`` has no ``head`` entry.
    """
    if not isinstance(params, Mapping) or "head" not in params:
        keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise ValueError(f"params must hold a 'head' entry (the model's 'params'); got {keys}.")
    return {k: v for k, v in params.items() if k != "head"}, params["head"]


def init_trainable(key: jax.Array, method: PromptMethod, head: Any) -> dict[str, Any]:
    """``{"prompts": method.init(key), "head": head}`` (the head starts from the pretrained one)."""
    return {"prompts": method.init(key), "head": head}


def prompted_logits(
    model: Any,
    frozen: Mapping[str, Any],
    trainable: Mapping[str, Any],
    method: PromptMethod,
    features: Mapping[str, jax.Array],
    missing: jax.Array,
) -> jax.Array:
    """Logits (b, classes) of the frozen backbone with ``method``'s prompts and the trained head.

    Input-conditioned methods (``method.conditioned``) get ``context``, the frozen backbone's
    ``modality_features`` of this input (each available modality's mean embedded token).

    Args:
      model: the ``MultimodalTransformer`` module.
      frozen: its parameters without ``head`` (``split_head``); never receive gradients.
      trainable: ``{"prompts", "head"}`` (``init_trainable``).
      method: the prompt method.
      features: ``{modality: (b, n_i)}``.
      missing: (b, M) bool missing pattern.
    """
    variables = {"params": {**jax.lax.stop_gradient(dict(frozen)), "head": trainable["head"]}}
    x, key_mask = model.apply(variables, features, missing, method="embed")
    context = None
    if method.conditioned:  # the available modalities' features, from the frozen embedding
        context = model.apply(variables, x, missing, method="modality_features")
    out = method.prompts(trainable["prompts"], missing, context)
    prompts, mask = (None, None) if out is None else out
    h = model.apply(variables, x, key_mask, prompts, mask, method="encode")
    return model.apply(variables, h, method="classify")


def macro_f1(pred: np.ndarray, labels: np.ndarray, *, num_classes: int) -> float:
    """Macro-averaged F1 over ``num_classes`` classes (a class absent from both counts as 0).

    ``F1_c = 2 TP_c / (2 TP_c + FP_c + FN_c)``; the result is the mean over classes.

    Raises:
      ValueError: if ``pred`` and ``labels`` differ in shape.
    """
    pred, labels = np.asarray(pred), np.asarray(labels)
    if pred.shape != labels.shape:
        raise ValueError(f"pred {pred.shape} and labels {labels.shape} must have one shape.")
    f1 = []
    for c in range(num_classes):
        tp = np.sum((pred == c) & (labels == c))
        denom = 2 * tp + np.sum((pred == c) & (labels != c)) + np.sum((pred != c) & (labels == c))
        f1.append(2 * tp / denom if denom else 0.0)
    return float(np.mean(f1))
