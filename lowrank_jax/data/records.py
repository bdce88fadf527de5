"""Labelled datasets as plain NumPy records, and deterministic stratified splits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["Dataset", "Splits", "split", "to_arrays"]


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A labelled dataset held in host memory.

    ``x[i]`` is the i-th example and ``y[i]`` its class id, an index into ``class_names``.
    Examples may be images (``float32``, shape ``(N, H, W, C)``), feature vectors or strings
    (``x`` of dtype ``object`` or ``str``). The record is immutable; ``take`` returns a new one.

    Attributes:
      x: ``(N, ...)`` examples.
      y: ``(N,)`` ``int32`` labels in ``[0, len(class_names))``.
      class_names: name of each class; labels are global ids into this tuple, so subsets made
        with ``take`` or ``split_by_classes`` keep the full tuple.

    Example:
      >>> ds = Dataset(np.zeros((4, 2), np.float32), np.array([0, 1, 1, 0]), ("a", "b"))
      >>> len(ds), ds.num_classes, ds.take([1, 2]).y.tolist()
      (4, 2, [1, 1])
    """

    x: np.ndarray
    y: np.ndarray
    class_names: tuple[str, ...]

    def __post_init__(self):
        x = self.x if isinstance(self.x, np.ndarray) else np.asarray(self.x)
        y = np.asarray(self.y)
        if x.ndim < 1:
            raise ValueError(f"Dataset.x must have a leading example axis; got a scalar {x!r}.")
        if y.ndim != 1:
            raise ValueError(f"Dataset.y must be 1-D (one label per example); got shape {y.shape}.")
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"Dataset.x and Dataset.y must have the same number of examples; got "
                f"{x.shape[0]} and {y.shape[0]}."
            )
        if y.size and not np.issubdtype(y.dtype, np.integer):
            raise TypeError(f"Dataset.y must hold integer class ids; got dtype {y.dtype}.")
        names = tuple(str(c) for c in self.class_names)
        if y.size and (y.min() < 0 or y.max() >= len(names)):
            raise ValueError(
                f"Dataset labels must lie in [0, {len(names)}) (one per class name); got range "
                f"[{y.min()}, {y.max()}]. Pass the full class_names tuple."
            )
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y.astype(np.int32, copy=False))
        object.__setattr__(self, "class_names", names)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __repr__(self) -> str:
        return (
            f"Dataset(x={self.x.dtype}{list(self.x.shape)}, y={self.y.dtype}{list(self.y.shape)}, "
            f"num_classes={self.num_classes})"
        )

    @property
    def num_classes(self) -> int:
        """Number of classes, ``len(class_names)`` (some may have no examples in a subset)."""
        return len(self.class_names)

    def take(self, indices: Sequence[int] | np.ndarray) -> Dataset:
        """Returns the examples at ``indices`` (integer indices or a boolean mask), in that order.

        Args:
          indices: ``(k,)`` integer indices into ``[0, len(self))`` or an ``(N,)`` boolean mask.

        Returns:
          A new ``Dataset`` with the same ``class_names``.
        """
        idx = np.asarray(indices)
        if idx.dtype != bool:
            idx = idx.astype(np.int64, copy=False).reshape(-1)
        return Dataset(self.x[idx], self.y[idx], self.class_names)


class Splits(NamedTuple):
    """Train, validation and test parts of one ``Dataset``."""

    train: Dataset
    valid: Dataset
    test: Dataset


def _apportion(counts: np.ndarray, total: int) -> np.ndarray:
    """Splits ``total`` over groups proportionally to ``counts`` (largest-remainder rounding).

    Each group gets ``floor`` or ``ceil`` of its quota ``counts * total / counts.sum()`` and the
    parts sum to ``total`` exactly; ties go to the lower group index.
    """
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    if n == 0 or total == 0:
        return np.zeros_like(counts)
    quotas = counts * total / n
    parts = np.floor(quotas).astype(np.int64)
    short = total - int(parts.sum())
    order = np.argsort(-(quotas - parts), kind="stable")
    parts[order[:short]] += 1
    return parts


def split(
    dataset: Dataset,
    *,
    seed: int,
    valid_fraction: float,
    test_fraction: float,
    stratify: bool = True,
) -> Splits:
    """Splits a dataset into disjoint train/valid/test parts, deterministically from ``seed``.

    The test part gets ``round(N * test_fraction)`` examples and the validation part
    ``round(N * valid_fraction)``; the rest is training data. With ``stratify=True`` each class
    ``c`` with ``n_c`` examples contributes ``floor`` or ``ceil`` of ``n_c * test_fraction`` test
    examples (largest-remainder rounding), and the validation examples are apportioned the same way
    over what remains, so class proportions agree across parts up to one or two examples.
    Which examples go where is drawn from ``np.random.default_rng(seed)``; each part keeps the
    original order of its examples.

    Args:
      dataset: the ``Dataset`` of ``N`` examples to split.
      seed: non-negative integer seed; the same seed gives the same split.
      valid_fraction: fraction of examples for validation, in ``[0, 1)``.
      test_fraction: fraction of examples for test, in ``[0, 1)``; with ``valid_fraction`` it must
        sum to less than 1.
      stratify: keep class proportions equal across parts.

    Returns:
      ``Splits(train, valid, test)``.

    Raises:
      ValueError: if a fraction is out of range or the fractions leave no training data.

    Example:
      >>> parts = split(load_digits(), seed=0, valid_fraction=0.1, test_fraction=0.2)
      >>> len(parts.train), len(parts.valid), len(parts.test)
      (1258, 180, 359)
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"split expects a Dataset; got {type(dataset).__name__}.")
    for name, frac in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= float(frac) < 1.0:
            raise ValueError(f"{name} must lie in [0, 1); got {frac}.")
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"valid_fraction + test_fraction must be < 1 to leave training data; got "
            f"{valid_fraction} + {test_fraction}."
        )
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; got {seed!r}.")

    n = len(dataset)
    n_test = int(round(n * test_fraction))
    n_valid = int(round(n * valid_fraction))
    rng = np.random.default_rng(int(seed))
    if stratify:
        classes, labels = np.unique(dataset.y, return_inverse=True)
        counts = np.bincount(labels, minlength=classes.size)
        test_counts = _apportion(counts, n_test)
        valid_counts = _apportion(counts - test_counts, n_valid)
        test_idx, valid_idx, train_idx = [], [], []
        for c in range(classes.size):
            members = rng.permutation(np.flatnonzero(labels == c))
            t, v = test_counts[c], valid_counts[c]
            test_idx.append(members[:t])
            valid_idx.append(members[t : t + v])
            train_idx.append(members[t + v :])
        test_idx, valid_idx, train_idx = (
            np.concatenate(p) if p else np.zeros(0, np.int64)
            for p in (test_idx, valid_idx, train_idx)
        )
    else:
        perm = rng.permutation(n)
        test_idx = perm[:n_test]
        valid_idx = perm[n_test : n_test + n_valid]
        train_idx = perm[n_test + n_valid :]
    return Splits(
        train=dataset.take(np.sort(train_idx)),
        valid=dataset.take(np.sort(valid_idx)),
        test=dataset.take(np.sort(test_idx)),
    )


def to_arrays(
    splits: Splits, *, encode: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """The parts of a split as dicts of model-input arrays plus labels, ready for batching.

    Each part's examples become ``encode(part.x)`` (by default ``{"x": part.x as float32}``;
    for text, a tokenizer call such as ``lambda x: models.tokenize(tok, list(x), max_len=64)``)
    and its labels ``"y"``.

    Args:
      splits: ``Splits`` from :func:`split` (parts of ``N_train``, ``N_valid``, ``N_test``).
      encode: ``(n, ...)`` examples -> dict of ``(n, ...)`` arrays; default float32 ``"x"``.

    Returns:
      ``{"train" | "valid" | "test": {**encode(x), "y": (n,) int labels}}``, rows in the
      order of each part.

    Raises:
      TypeError: if ``splits`` is not a ``Splits``.
      ValueError: if ``encode`` returns a ``"y"`` entry or arrays of another length.

    Example:
      >>> parts = split(load_digits(), seed=0, valid_fraction=0.1, test_fraction=0.2)
      >>> arrays = to_arrays(parts)
      >>> arrays["test"]["x"].shape, arrays["test"]["y"].shape
      ((359, 8, 8, 1), (359,))
    """
    if not isinstance(splits, Splits):
        raise TypeError(f"to_arrays expects the Splits of split(); got {type(splits).__name__}.")
    out = {}
    for name, part in splits._asdict().items():
        inputs = {"x": np.asarray(part.x, np.float32)} if encode is None else encode(part.x)
        bad = [k for k, v in inputs.items() if k == "y" or len(v) != len(part)]
        if bad:
            raise ValueError(
                f"encode must return arrays of the part's {len(part)} rows and no 'y'; got {bad}."
            )
        out[name] = {**inputs, "y": part.y}
    return out
