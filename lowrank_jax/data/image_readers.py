"""Images of an :class:`~lowrank_jax.data.tfds_images.ImageSource`, read and transformed on demand.

* :class:`ImageBatches`: resumable training batches (an order per epoch, augmentation seeded by
  ``(seed, epoch, position)``);
* :class:`ImageRows`: a row-sliceable stand-in for an array of transformed images, which the
  continual methods and evaluation read a batch at a time (a task's ``x``, a test set's ``"x"``).

Images are decoded on the source's ``num_threads`` threads; no dataset is held in memory.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lowrank_jax.data.image_transforms import Transform
from lowrank_jax.data.iterators import BatchIterator
from lowrank_jax.data.records import Dataset
from lowrank_jax.data.tfds_images import ImageSource

__all__ = ["ImageBatches", "ImageRows"]


class ImageBatches:
    """Resumable batches ``{"x": (b, s, s, 3) float32, "y": (b,) int32}`` of some rows of an
    :class:`ImageSource`, transformed on the host.

    The rows are visited in :class:`~lowrank_jax.data.BatchIterator`'s order (a permutation per
    epoch drawn from ``(seed, epoch)``); image ``j`` of the batch at ``(epoch, position)`` is
    transformed with the ``j``-th generator spawned from
    ``numpy.random.default_rng([seed, epoch, position])``, so ``state()`` / ``restore`` (or
    ``state=``) reproduce the batches, augmentation included. The images of a batch are read,
    decoded and transformed on the source's ``num_threads`` threads.

    Args:
      source: the images.
      rows: the rows to visit: an array of row ids or a ``Dataset`` of them (a task of
        ``split_by_classes(source.index(), ...)``).
      transform: ``(image, rng) -> (s, s, 3)`` (``train_transform`` / ``eval_transform``).
      batch_size, seed, shuffle, drop_remainder, num_epochs, state: as ``BatchIterator``'s.
      extra: entries added to every batch, each row the same (e.g. ``{"mask": (C,) bool}``
        gives ``batch["mask"]: (b, C)``).
    """

    def __init__(
        self,
        source: ImageSource,
        rows: np.ndarray | Dataset,
        *,
        transform: Transform,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_remainder: bool = True,
        num_epochs: int | None = None,
        state: Mapping[str, int] | None = None,
        extra: Mapping[str, np.ndarray] | None = None,
    ):
        rows = _check_rows(source, rows)
        self._extra = {k: np.asarray(v) for k, v in (extra or {}).items()}
        self._source = source
        self._transform = transform
        self._seed = int(seed)
        self._order = BatchIterator(
            {"row": rows, "y": source.labels[rows]},
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            drop_remainder=drop_remainder,
            num_epochs=num_epochs,
            state=state,
        )

    def __iter__(self) -> ImageBatches:
        return self

    def __len__(self) -> int:
        return len(self._order)

    @property
    def num_examples(self) -> int:
        return self._order.num_examples

    def state(self) -> dict[str, int]:
        """``{"epoch", "position"}`` of the next batch."""
        return self._order.state()

    def restore(self, state: Mapping[str, int]) -> ImageBatches:
        self._order.restore(state)
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        where = self._order.state()
        batch = next(self._order)
        rng = np.random.default_rng([self._seed, where["epoch"], where["position"]])
        x = _transformed(self._source, batch["row"], self._transform, rng.spawn(len(batch["row"])))
        rows = {k: np.broadcast_to(v, (len(x), *v.shape)) for k, v in self._extra.items()}
        return {"x": x, "y": batch["y"], **rows}


class ImageRows:
    """Some rows of an :class:`ImageSource`, transformed, read when sliced: a stand-in for an
    ``(N, s, s, 3)`` float32 array that is never held in memory.

    ``len(rows)``, ``rows.shape`` and ``rows[index]`` (an int, a slice or an array of positions)
    behave as on the array, with row ``i`` transformed by a generator seeded by ``(seed, row id)``
    (so a row reads the same each time). This is what :class:`lowrank_jax.continual.Task`'s ``x``
    and a test set's ``"x"`` may be: the continual methods, their heads and
    :func:`lowrank_jax.continual.evaluation.evaluate_tasks` read such inputs a batch at a time::

        test = {"x": data.ImageRows(source, task.x, transform=data.eval_transform(224)),
                "y": task.y}

    Args:
      source: the images.
      rows: the row ids (an array, or a ``Dataset`` of them as ``split_by_classes`` gives).
      transform: ``(image, rng) -> (s, s, 3)``, usually ``eval_transform``.
      seed: seeds the transform's generators (for a random transform).
    """

    def __init__(
        self,
        source: ImageSource,
        rows: np.ndarray | Dataset,
        *,
        transform: Transform,
        seed: int = 0,
    ):
        self._rows = _check_rows(source, rows)
        if not len(self._rows):
            raise ValueError("rows is empty: an ImageRows needs at least one row.")
        self._source = source
        self._transform = transform
        self._seed = int(seed)
        self._shape = np.shape(
            transform(source.image(int(self._rows[0])), np.random.default_rng(0))
        )

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def source(self) -> ImageSource:
        return self._source

    @property
    def rows(self) -> np.ndarray:
        """The row ids of the source, in order."""
        return self._rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self._shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def __getitem__(self, index: Any) -> np.ndarray:
        rows = self._rows[index]
        if np.ndim(rows) == 0:
            return self[np.asarray([index])][0]
        rngs = [np.random.default_rng([self._seed, int(r)]) for r in rows]
        return _transformed(self._source, rows, self._transform, rngs, self._shape)

    def take(self, indices: Any, axis: int = 0, out: None = None, mode: str = "raise") -> ImageRows:
        """The rows at ``indices``, still read on demand (what ``np.take(rows, indices, axis=0)``
        returns, so code that subsets arrays with ``np.take`` subsets these lazily)."""
        if axis != 0 or out is not None or mode != "raise":
            raise ValueError("ImageRows.take supports only axis=0, out=None, mode='raise'.")
        rows = self._rows[np.asarray(indices, np.int64)]
        return ImageRows(self._source, rows, transform=self._transform, seed=self._seed)

    @classmethod
    def concatenate(cls, parts: Sequence[ImageRows]) -> ImageRows:
        """The rows of ``parts`` in order (parts of one source with one transform)."""
        first = parts[0]
        if any(
            p._source is not first._source or p._transform is not first._transform for p in parts
        ):
            raise ValueError("ImageRows.concatenate needs parts of one source and one transform.")
        rows = np.concatenate([p._rows for p in parts])
        return cls(first._source, rows, transform=first._transform, seed=first._seed)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self[:], dtype)


def _check_rows(source: ImageSource, rows: np.ndarray | Dataset) -> np.ndarray:
    rows = np.asarray(rows.x if isinstance(rows, Dataset) else rows, np.int64)
    if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= len(source))):
        raise ValueError(f"rows must be a 1-D array of row ids of the {len(source)} rows.")
    return rows


def _transformed(
    source: ImageSource,
    rows: np.ndarray,
    transform: Transform,
    rngs: Sequence[np.random.Generator],
    shape: tuple[int, ...] = (),
) -> np.ndarray:
    """``(len(rows), ...)`` float32: each row's image read, decoded and transformed, on the
    source's threads."""
    jobs = list(zip(np.asarray(rows).tolist(), rngs, strict=True))
    if not jobs:
        return np.zeros((0, *shape), np.float32)

    def one(job: tuple[int, np.random.Generator]) -> np.ndarray:
        return transform(source.image(job[0]), job[1])

    if source.num_threads <= 1 or len(jobs) <= 1:
        return np.stack([one(j) for j in jobs]).astype(np.float32, copy=False)
    with concurrent.futures.ThreadPoolExecutor(source.num_threads) as pool:
        return np.stack(list(pool.map(one, jobs))).astype(np.float32, copy=False)
