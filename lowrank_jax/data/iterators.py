"""A checkpointable, deterministic batch iterator over in-memory arrays."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from lowrank_jax.data.records import Dataset

__all__ = ["BatchIterator"]


def _as_arrays(data) -> dict[str, np.ndarray]:
    if isinstance(data, Dataset):
        arrays = {"x": data.x, "y": data.y}
    elif isinstance(data, Mapping):
        arrays = {str(k): np.asarray(v) for k, v in data.items()}
    elif isinstance(data, tuple) and len(data) == 2:
        arrays = {"x": np.asarray(data[0]), "y": np.asarray(data[1])}
    else:
        raise TypeError(
            "BatchIterator expects a Dataset, a mapping of name -> array, or an (x, y) tuple; "
            f"got {type(data).__name__}."
        )
    if not arrays:
        raise ValueError("BatchIterator needs at least one array.")
    sizes = {k: (v.shape[0] if v.ndim else None) for k, v in arrays.items()}
    if None in sizes.values() or len(set(sizes.values())) != 1:
        raise ValueError(
            f"All arrays must share the leading (example) axis; got leading sizes {sizes}."
        )
    return arrays


class BatchIterator(Iterator[dict[str, np.ndarray]]):
    """Deterministic, resumable mini-batches over in-memory arrays.

    Epoch ``e`` visits the ``n`` examples in the order
    ``np.random.default_rng([seed, e]).permutation(n)`` (or ``0..n-1`` without shuffling), so the
    order of any epoch depends only on ``(seed, e)``, never on what was iterated before. The
    iterator's whole state is the pair ``(epoch, position)`` of plain ints: ``state()`` returns
    it, and an iterator built with ``state=`` (or after ``restore``) yields exactly the batches the
    original would have yielded next. Iteration runs for ``num_epochs`` epochs, or forever when
    ``num_epochs`` is None. Batches are dicts of NumPy arrays on the host; putting them on devices
    (and sharding them) is the caller's business.

    Args:
      data: a ``Dataset`` (batches ``{"x", "y"}``), a mapping ``name -> (n, ...)`` array (batches
        with the same keys), or an ``(x, y)`` tuple.
      batch_size: examples per batch ``b``.
      seed: non-negative integer seed of the shuffling.
      shuffle: shuffle each epoch; otherwise examples come in their stored order.
      drop_remainder: drop the last ``n mod b`` examples of each epoch so all batches have ``b``
        examples; otherwise the last batch of an epoch is smaller.
      num_epochs: stop after this many epochs; None iterates forever.
      state: a ``state()`` dict to resume from.

    Raises:
      ValueError: if ``batch_size`` is not positive, exceeds ``n`` with ``drop_remainder``, or the
        arrays disagree on ``n``.

    Example:
      >>> it = BatchIterator(load_digits(), batch_size=32, seed=0)
      >>> _ = next(it); saved = it.state()          # {"epoch": 0, "position": 32}
      >>> a = next(it)["y"]
      >>> b = next(BatchIterator(load_digits(), batch_size=32, seed=0, state=saved))["y"]
      >>> bool((a == b).all())
      True
    """

    def __init__(
        self,
        data,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_remainder: bool = True,
        num_epochs: int | None = None,
        state: Mapping[str, int] | None = None,
    ):
        self._arrays = _as_arrays(data)
        self._n = int(next(iter(self._arrays.values())).shape[0])
        if self._n == 0:
            raise ValueError("BatchIterator needs at least one example.")
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}.")
        if drop_remainder and batch_size > self._n:
            raise ValueError(
                f"batch_size={batch_size} exceeds the {self._n} examples, so drop_remainder=True "
                "would give no batches; lower batch_size or pass drop_remainder=False."
            )
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {seed!r}.")
        if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
            raise ValueError(f"num_epochs must be a positive integer or None; got {num_epochs!r}.")
        self._batch_size = int(batch_size)
        self._seed = int(seed)
        self._shuffle = bool(shuffle)
        self._drop_remainder = bool(drop_remainder)
        self._num_epochs = num_epochs
        # Examples used per epoch: with drop_remainder the trailing n mod b are skipped.
        self._stop = self._n - self._n % self._batch_size if drop_remainder else self._n
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order = np.arange(self._n)
        if state is not None:
            self.restore(state)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_examples(self) -> int:
        """Number of examples ``n`` in the data."""
        return self._n

    def __len__(self) -> int:
        """Batches per epoch: ``n // b`` with ``drop_remainder``, else ``ceil(n / b)``."""
        return -(-self._stop // self._batch_size)

    def __iter__(self) -> BatchIterator:
        return self

    def state(self) -> dict[str, int]:
        """The position of the next batch, ``{"epoch": int, "position": int}`` (JSON-friendly)."""
        return {"epoch": self._epoch, "position": self._position}

    def restore(self, state: Mapping[str, int]) -> BatchIterator:
        """Moves the iterator to ``state`` (from ``state()``) and returns it.

        Raises:
          ValueError: if ``state`` lacks ``epoch``/``position`` or they are out of range.
        """
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"state must be a dict with int 'epoch' and 'position' (from state()); got {state!r}."
            ) from err
        if epoch < 0 or not 0 <= position <= self._n:
            raise ValueError(
                f"state {state!r} is out of range for {self._n} examples (need epoch >= 0 and "
                f"0 <= position <= {self._n})."
            )
        if position >= self._stop:
            epoch, position = epoch + 1, 0
        self._epoch, self._position = epoch, position
        return self

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The ``(n,)`` order in which epoch ``epoch`` visits the examples."""
        if not self._shuffle:
            return np.arange(self._n)
        return np.random.default_rng([self._seed, int(epoch)]).permutation(self._n)

    def __next__(self) -> dict[str, np.ndarray]:
        if self._num_epochs is not None and self._epoch >= self._num_epochs:
            raise StopIteration
        if self._order_epoch != self._epoch:
            self._order = self.epoch_order(self._epoch)
            self._order_epoch = self._epoch
        end = min(self._position + self._batch_size, self._stop)
        idx = self._order[self._position : end]
        self._position = end
        if self._position >= self._stop:
            self._epoch, self._position = self._epoch + 1, 0
        return {k: v[idx] for k, v in self._arrays.items()}
