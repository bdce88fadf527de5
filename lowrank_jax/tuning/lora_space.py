"""The discrete LoRA hyper-parameter space of LoRA-BO (P15) and its encodings for a GP surrogate.

A space is five axes (rank, alpha, learning rate, batch size, dropout); the grid is their
Cartesian product flattened in C order (rank slowest, dropout fastest). Encodings of the ``c``
configurations:

* :func:`describe_configurations`: text ``"rank=16, alpha=32, learning_rate=0.0002, batch_size=8,
  dropout=0.05"`` (specs §15 (2)), to be embedded by a frozen language model after
  :data:`LORA_PROMPT` (see :func:`lowrank_jax.tuning.minilm_embedding`);
* :func:`knowledge_features`: the hand-made "prompt knowledge" features of specs §15 (4a):
  ``log lr, log(α/r), log r, log(lr·α/r), log batch, lr/batch, dropout``;
* :func:`ordinal_features`: each axis' value index; :func:`onehot_features`: one-hot per axis;
* :func:`value_tokens`: one token per axis, a one-hot over all axis values, ``(c, 5, Σ s_i)``: the
  states a learnable residual token reads (specs §15 (4d)).

References:
  P15 LoRA-BO (arXiv 2602.11171), reconstructed as in ``papers/specs.md`` §15; the prompt text
  below is our reconstruction (the paper's prompt is not public).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "LORA_PROMPT",
    "LoraSearchSpace",
    "describe_configurations",
    "knowledge_features",
    "lora_grid_configurations",
    "onehot_features",
    "ordinal_features",
    "standardize_features",
    "value_tokens",
]

# A domain-aware prompt in the spirit of the paper (its text is not public: reconstruction).
LORA_PROMPT = (
    "LoRA hyperparameters: the update is scaled by alpha over rank, so the step grows with "
    "learning_rate times alpha over rank; a larger rank adds capacity; a smaller batch_size adds "
    "noise; dropout regularises."
)

_AXES = ("rank", "alpha", "learning_rate", "batch_size", "dropout")


class LoraSearchSpace(NamedTuple):
    """The axes of a LoRA grid (each a tuple of distinct positive values; dropout in [0, 1))."""

    ranks: tuple[int, ...] = (1, 2, 4, 8, 16)
    alphas: tuple[float, ...] = (1.0, 4.0, 8.0, 16.0, 32.0, 64.0)
    learning_rates: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
    batch_sizes: tuple[int, ...] = (8, 16, 32, 64)
    dropouts: tuple[float, ...] = (0.0, 0.1, 0.2)

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid's axis sizes, ``(s_rank, s_alpha, s_lr, s_batch, s_dropout)``."""
        return tuple(len(a) for a in self)


def _check_space(space: LoraSearchSpace) -> None:
    if not isinstance(space, LoraSearchSpace):
        raise TypeError(f"expected a LoraSearchSpace, got {type(space).__name__}.")
    for name, values in zip(_AXES, space, strict=True):
        v = np.asarray(values, np.float64)
        if v.ndim != 1 or v.size == 0 or len(set(v.tolist())) != v.size:
            raise ValueError(
                f"axis {name} must be a non-empty tuple of distinct values; got {values}."
            )
        low_ok = np.all(v >= 0) if name == "dropout" else np.all(v > 0)
        if not low_ok or (name == "dropout" and np.any(v >= 1)):
            raise ValueError(f"axis {name} has out-of-range values {values}.")
    for name, values in (("rank", space.ranks), ("batch_size", space.batch_sizes)):
        if not all(isinstance(x, int | np.integer) for x in values):
            raise TypeError(f"axis {name} must hold ints; got {values}.")


def lora_grid_configurations(space: LoraSearchSpace) -> dict[str, np.ndarray]:
    """Every configuration of the grid, C order.

    Returns:
      ``{"rank", "alpha", "learning_rate", "batch_size", "dropout"}``: ``(c,)`` value arrays, and
      ``"index"``: ``(c, 5)`` int value indices per axis (``c = prod(space.shape)``).

    Raises:
      TypeError or ValueError: a malformed space.
    """
    _check_space(space)
    index = np.stack(np.unravel_index(np.arange(int(np.prod(space.shape))), space.shape), -1)
    out = {
        name: np.asarray(values)[index[:, j]]
        for j, (name, values) in enumerate(zip(_AXES, space, strict=True))
    }
    out["index"] = index.astype(np.int32)
    return out


def _fmt(x: float) -> str:
    return f"{x:g}"


def describe_configurations(configs: dict[str, np.ndarray]) -> list[str]:
    """``"rank=16, alpha=32, learning_rate=0.0002, batch_size=8, dropout=0.05"`` per configuration."""
    c = len(configs["rank"])
    return [", ".join(f"{a}={_fmt(configs[a][i])}" for a in _AXES) for i in range(c)]


def knowledge_features(configs: dict[str, np.ndarray]) -> np.ndarray:
    """The hand-made knowledge features (specs §15 (4a)), ``(c, 7)`` float64.

    Columns: ``log lr, log(α/r), log r, log(lr·α/r), log batch, lr/batch, dropout`` (the effective
    LoRA step ``lr·α/r`` and the noise scale ``lr/batch`` are the known interactions).
    """
    lr = configs["learning_rate"].astype(np.float64)
    r = configs["rank"].astype(np.float64)
    a = configs["alpha"].astype(np.float64)
    b = configs["batch_size"].astype(np.float64)
    cols = [np.log(lr), np.log(a / r), np.log(r), np.log(lr * a / r), np.log(b), lr / b]
    return np.stack([*cols, configs["dropout"].astype(np.float64)], -1)


def ordinal_features(configs: dict[str, np.ndarray]) -> np.ndarray:
    """Each axis' value index, ``(c, 5)`` float64 (the raw ordinal encoding)."""
    return configs["index"].astype(np.float64)


def _sizes(configs: dict[str, np.ndarray]) -> list[int]:
    return [int(configs["index"][:, j].max()) + 1 for j in range(len(_AXES))]


def onehot_features(
    configs: dict[str, np.ndarray], sizes: Sequence[int] | None = None
) -> np.ndarray:
    """One-hot per axis, concatenated: ``(c, Σ s_i)`` float64 (``sizes`` default: from the data)."""
    sizes = _sizes(configs) if sizes is None else list(sizes)
    return np.concatenate([np.eye(s)[configs["index"][:, j]] for j, s in enumerate(sizes)], axis=-1)


def value_tokens(configs: dict[str, np.ndarray], sizes: Sequence[int] | None = None) -> np.ndarray:
    """One token per axis, one-hot over the ``Σ s_i`` axis values: ``(c, 5, Σ s_i)`` float32."""
    sizes = _sizes(configs) if sizes is None else list(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ids = configs["index"] + offsets[None, :]
    return np.eye(int(np.sum(sizes)), dtype=np.float32)[ids]


def standardize_features(features: np.ndarray) -> np.ndarray:
    """Per-column zero mean and unit variance (constant columns become 0), float32.

    Raises:
      ValueError: ``features`` is not 2-D or holds NaN/inf.
    """
    f = np.asarray(features, np.float64)
    if f.ndim != 2:
        raise ValueError(f"features must have shape (c, p); got {f.shape}.")
    if not np.all(np.isfinite(f)):
        raise ValueError("features hold NaN/inf; check the configurations (log of 0?).")
    sd = f.std(0)
    return ((f - f.mean(0)) / np.where(sd > 0, sd, 1.0)).astype(np.float32)
