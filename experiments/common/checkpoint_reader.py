"""Reading a run's saved checkpoints back as a lazy sequence of parameter pytrees.

The trajectory merges of ``lowrank_jax.merging`` take checkpoints as any iterable of pytrees (and
a Sequence or a zero-argument function for the two-pass Extra-Merge); the library does not import
orbax. This module turns the orbax directory that ``experiments.common.fit`` writes
(``<workdir>/checkpoints/<step>/{state,meta}``) into such a sequence: item ``i`` is restored from
disk when asked for, so a merge holds one checkpoint at a time::

    ckpts = CheckpointSequence(workdir / "checkpoints", steps=saved_steps(...)[-40:])
    merged = merging.extra_merge(ckpts, window=10, key=jax.random.key(0))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import orbax.checkpoint as ocp

from experiments.common import checkpoint as ckpt_lib

__all__ = ["CheckpointSequence", "saved_steps"]


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """The steps saved under ``directory`` (a ``checkpoints/`` folder of ``fit``), ascending."""
    with ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)), item_names=("state", "meta")
    ) as manager:
        return sorted(manager.all_steps())


class CheckpointSequence(Sequence):
    """A lazy ``Sequence`` of the parameter pytrees saved at ``steps`` under ``directory``.

    Args:
      directory: the ``checkpoints/`` folder written by ``experiments.common.fit``.
      target: a train-state pytree (arrays or ``jax.ShapeDtypeStruct``) with the saved state's
        structure, e.g. the freshly initialised state (restored arrays get its dtypes and
        shardings); None restores the saved structure as plain dicts and lists.
      steps: the steps to read, oldest first (default: all saved steps).
      select: maps a restored train state to the pytree to merge (default: ``state["params"]``).

    Raises:
      ValueError: a requested step is not on disk (the message lists what is).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        target: Any = None,
        steps: Sequence[int] | None = None,
        select: Callable[[Any], Any] | None = None,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        available = saved_steps(self.directory)
        self.steps = list(available if steps is None else steps)
        missing = sorted(set(self.steps) - set(available))
        if missing:
            raise ValueError(
                f"steps {missing} are not saved in {self.directory} (saved: {available}); "
                "keep them with fit(max_to_keep=...)"
            )
        self._abstract = None if target is None else ckpt_lib.abstract_like(target)
        self._select = select or (lambda state: state["params"])

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        step = self.steps[index]
        with ocp.CheckpointManager(self.directory, item_names=("state", "meta")) as manager:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(self._abstract)),
            )
        return self._select(restored["state"])
