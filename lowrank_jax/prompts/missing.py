"""Missing-modality patterns as boolean masks: sampling, validation and missing-type ids.

A batch's pattern is ``missing`` (b, M) bool, True where modality i of example b is missing.
The *missing type* of an example is the integer whose bit i is ``missing[b, i]``:
``type = sum_i missing_i 2^i``, in ``[0, 2^M - 1)`` (0 = complete; the all-missing pattern is
not allowed). With M = 2 (image, text): 0 complete, 1 modality 0 missing, 2 modality 1 missing,
the three missing types of MAP.

References:
  Lee, Tsai, Chiu, Lee, "Multimodal Prompting with Missing Modalities for Visual Recognition",
  CVPR 2023 (MAP; the missing-rate protocol: a fraction eta of the examples miss a modality,
  "missing-both" splits them evenly between the modalities).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "check_rate",
    "missing_type",
    "num_missing_types",
    "sample_missing",
]


def check_rate(rate: float) -> float:
    """``rate`` as a float in [0, 1].

    Raises:
      TypeError: if ``rate`` is not a real number.
      ValueError: if it lies outside [0, 1].
    """
    if isinstance(rate, bool) or not isinstance(rate, int | float | np.floating | np.integer):
        raise TypeError(f"missing rate must be a number in [0, 1]; got {rate!r}.")
    rate = float(rate)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"missing rate must lie in [0, 1] (a fraction of examples); got {rate}.")
    return rate


def num_missing_types(num_modalities: int) -> int:
    """``2^M - 1``: the complete pattern and every pattern that keeps at least one modality.

    Raises:
      ValueError: if ``num_modalities`` < 1.
    """
    if not isinstance(num_modalities, int) or num_modalities < 1:
        raise ValueError(f"num_modalities must be an int >= 1; got {num_modalities!r}.")
    return 2**num_modalities - 1


def missing_type(missing: jax.Array) -> jax.Array:
    """Missing-type ids ``sum_i missing[:, i] 2^i`` of a (b, M) boolean pattern, int32 (b,).

    Raises:
      ValueError: if ``missing`` is not 2-D.
    """
    missing = jnp.asarray(missing)
    if missing.ndim != 2:
        raise ValueError(f"missing must be a (b, M) boolean array; got shape {missing.shape}.")
    weights = 2 ** jnp.arange(missing.shape[1], dtype=jnp.int32)
    return jnp.sum(missing.astype(jnp.int32) * weights, axis=1)


def sample_missing(
    key: jax.Array, n: int, *, num_modalities: int, rate: float, kind: str | int = "both"
) -> np.ndarray:
    """A missing pattern for ``n`` examples: exactly ``round(rate * n)`` of them miss a modality.

    ``kind="both"`` (MAP's missing-both, generalised to M modalities): the missing examples are
    split as evenly as possible between the modalities, each missing exactly one. ``kind=i``
    (an int): every missing example misses modality i. ``kind="complete"``: none is missing.

    Args:
      key: PRNG key (which examples miss what).
      n: number of examples.
      num_modalities: M.
      rate: the missing rate eta in [0, 1].
      kind: ``"both"``, ``"complete"`` or a modality index in [0, M).

    Returns:
      ``(n, M)`` bool numpy array, True where missing; no row is all True (M >= 2).

    Raises:
      ValueError: for a rate outside [0, 1], M < 2 with a non-zero rate, or an unknown kind.

    Example:
      >>> m = sample_missing(jax.random.key(0), 10, num_modalities=2, rate=0.6)
      >>> int(m.any(1).sum()), m.sum(0).tolist()
      (6, [3, 3])
    """
    rate = check_rate(rate)
    num_missing_types(num_modalities)
    if kind not in ("both", "complete") and not (
        isinstance(kind, int) and not isinstance(kind, bool) and 0 <= kind < num_modalities
    ):
        raise ValueError(
            f"kind={kind!r} is invalid: use 'both', 'complete' or a modality index in "
            f"[0, {num_modalities})."
        )
    out = np.zeros((n, num_modalities), bool)
    if kind == "complete" or rate == 0.0:
        return out
    if num_modalities < 2:
        raise ValueError("with a single modality nothing can be missing; use rate=0.")
    count = int(round(rate * n))
    order = np.asarray(jax.random.permutation(key, n))[:count]
    which = np.arange(count) % num_modalities if kind == "both" else np.full(count, kind)
    out[order, which] = True
    return out
