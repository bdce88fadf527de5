"""A targeted-selection problem on real text: the First Folio, one genre as the target (P11).

The plays of ``lowrank_jax.data.load_shakespeare`` are cut into passages of ``seq_len + 1``
characters, encoded by a character vocabulary (the passages' distinct characters, sorted), and
split per play into pre-training, pool, validation and test passages. The target is one genre
(the Histories by default): the few-shot validation set holds ``val_per_play`` passages of each
target play, one subtask per play (as GIST groups a target's validation set into subtasks), and
the test set ``test_per_play`` passages of each. The pool holds ``pool_per_play`` passages of
every play plus distractors: copies of a ``distractor_fraction`` of the pool with a
``corrupt_fraction`` of their characters replaced by random ones. It is the text counterpart of
:func:`~lowrank_jax.selection.make_synthetic_pool` (same ``pool_kind`` codes:
``POOL_KINDS = ("relevant", "noisy", "irrelevant")``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lowrank_jax import data
from lowrank_jax.data.shakespeare import GENRES, PLAYS

__all__ = ["TextPool", "make_shakespeare_pool"]


class TextPool(NamedTuple):
    """Encoded passages of a text selection problem: ``(·, L)`` int32 character codes, ``L =
    seq_len + 1`` (inputs ``[:, :-1]``, next-character targets ``[:, 1:]``).

    ``pool_kind`` indexes ``POOL_KINDS`` (0 a target-genre passage, 1 a corrupted distractor,
    2 another genre's passage); ``val_subtask`` indexes ``subtasks`` (the target plays' keys in
    ``data.shakespeare.PLAYS``); ``vocab[c]`` is the character of code ``c``.
    """

    pretrain_x: np.ndarray
    pool_x: np.ndarray
    pool_kind: np.ndarray
    val_x: np.ndarray
    val_subtask: np.ndarray
    test_x: np.ndarray
    vocab: tuple[str, ...]
    subtasks: tuple[str, ...]


def make_shakespeare_pool(
    seed: int,
    *,
    seq_len: int = 64,
    target_genre: str = "history",
    pretrain_per_play: int = 200,
    pool_per_play: int = 80,
    val_per_play: int = 5,
    test_per_play: int = 30,
    distractor_fraction: float = 0.1,
    corrupt_fraction: float = 0.3,
) -> TextPool:
    """Builds the pool, validation, test and pre-training passages (numpy, from ``seed``).

    Each play contributes at most ``pretrain_per_play + pool_per_play + val_per_play +
    test_per_play`` passages (drawn by ``load_shakespeare``), shuffled by ``seed`` and cut in that
    order, so no passage is in two splits. Pre-training and pool passages come from all 35 plays,
    validation and test passages from the ``target_genre`` plays only; ``round(distractor_fraction
    · n)`` of the ``n`` clean pool passages are copied as distractors, appended after them.

    Args:
      seed: seed of the split, the distractors and their corruption.
      seq_len: characters a model reads; passages are ``seq_len + 1`` long.
      target_genre: one of ``data.shakespeare.GENRES``.
      pretrain_per_play, pool_per_play, val_per_play, test_per_play: passages per play.
      distractor_fraction: distractors per clean pool passage, in [0, 1].
      corrupt_fraction: chance that a distractor's character is replaced, in [0, 1].

    Returns:
      A :class:`TextPool`: ``pretrain_x`` ``(35·pretrain_per_play, L)``, ``pool_x`` ``(n +
      n_d, L)`` with ``n = 35·pool_per_play``, ``val_x`` ``(t·val_per_play, L)`` and ``test_x``
      ``(t·test_per_play, L)`` for ``t`` target plays (fewer rows where a play is short).

    Raises:
      ValueError: a non-positive size, a fraction outside [0, 1] or an unknown genre.
      ModuleNotFoundError: the ``shakespeare`` package is missing (see ``load_shakespeare``).

    References:
      P11 GIST (specs.md §11: a pool with relevant, noisy and irrelevant examples and a few-shot
      validation set in subtasks); the text version, its genres-as-tasks and distractors are this
      library's construction.

    Example::

      p = make_shakespeare_pool(0, seq_len=32, pretrain_per_play=8, pool_per_play=12,
                                val_per_play=2, test_per_play=3)
      "".join(p.vocab[c] for c in p.val_x[0])   # a passage of p.subtasks[p.val_subtask[0]]
    """
    sizes = {
        "seq_len": seq_len,
        "pretrain_per_play": pretrain_per_play,
        "pool_per_play": pool_per_play,
        "val_per_play": val_per_play,
        "test_per_play": test_per_play,
    }
    for name, value in sizes.items():
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: a positive integer")
    for name, value in (("distractor_fraction", distractor_fraction),
                        ("corrupt_fraction", corrupt_fraction)):  # fmt: skip
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value!r} is invalid: a fraction in [0, 1]")
    if target_genre not in GENRES:
        raise ValueError(f"target_genre={target_genre!r} is invalid: one of {GENRES}")
    per = pretrain_per_play + pool_per_play + val_per_play + test_per_play
    ds = data.load_shakespeare(label="play", passage_chars=seq_len + 1, max_passages_per_play=per)
    vocab = sorted(set("".join(ds.x)))
    table = {ch: i for i, ch in enumerate(vocab)}
    enc = np.asarray([[table[ch] for ch in s] for s in ds.x], np.int32)
    rng = np.random.default_rng([seed, 11])
    parts: dict[str, list] = {"pre": [], "pool": [], "val": [], "test": []}
    pool_target, val_sub = [], []
    targets = [k for k in ds.class_names if PLAYS[k][0] == target_genre]
    for play, key in enumerate(ds.class_names):
        idx = rng.permutation(np.flatnonzero(ds.y == play))
        cut = np.cumsum([pretrain_per_play, pool_per_play, val_per_play])
        pre, pool, val, test = np.split(idx, cut)
        parts["pre"].append(pre)
        parts["pool"].append(pool)
        pool_target += [key in targets] * len(pool)
        if key in targets:
            parts["val"].append(val)
            parts["test"].append(test[:test_per_play])
            val_sub += [targets.index(key)] * len(val)
    pick = {k: enc[np.concatenate(v)] for k, v in parts.items()}
    n_pool = len(pick["pool"])
    n_bad = int(round(distractor_fraction * n_pool))
    src = rng.choice(n_pool, n_bad, replace=False)
    bad = pick["pool"][src].copy()
    mask = rng.random(bad.shape) < corrupt_fraction
    bad[mask] = rng.integers(0, len(vocab), int(mask.sum()))
    return TextPool(
        pretrain_x=pick["pre"],
        pool_x=np.concatenate([pick["pool"], bad]),
        pool_kind=np.concatenate([np.where(pool_target, 0, 2), np.ones(n_bad, int)]),
        val_x=pick["val"],
        val_subtask=np.asarray(val_sub),
        test_x=pick["test"],
        vocab=tuple(vocab),
        subtasks=tuple(targets),
    )
