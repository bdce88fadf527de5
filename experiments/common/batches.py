"""What :func:`~experiments.common.loop.fit` reads batches from: a resumable iterator.

``fit`` saves the iterator's position (``state()``) with every checkpoint and restores it
(``restore(state)``) on resume, so a resumed run sees the batches it would have seen.
``lowrank_jax.data.BatchIterator`` is one; :class:`MapBatches` transforms the batches of one on
the fly (tokenise, reshape) and keeps its position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

__all__ = ["MapBatches", "ResumableIterator"]


class ResumableIterator(Protocol):
    """What :func:`fit` needs from a data source: batches, and a position it can save."""

    def __next__(self) -> Any: ...

    def state(self) -> Any: ...

    def restore(self, state: Any) -> None: ...


@dataclasses.dataclass
class MapBatches:
    """Applies ``fn`` to every batch of a resumable iterator, keeping ``state``/``restore``.

    Example: ``MapBatches(BatchIterator(train, batch_size=32, seed=0), lambda b: {"x": b.x,
    "y": b.y})``.
    """

    batches: Any
    fn: Callable[[Any], Any]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.fn(next(self.batches))

    def state(self) -> Any:
        return self.batches.state()

    def restore(self, state: Any) -> None:
        self.batches.restore(state)
