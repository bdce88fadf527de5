"""The First Folio selection problem: disjoint splits of real passages, target-genre subtasks,
distractors that are corrupted copies of pool passages."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest

from lowrank_jax import data, selection
from lowrank_jax.data.shakespeare import PLAYS

_SIZES = dict(seq_len=24, pretrain_per_play=3, pool_per_play=4, val_per_play=2, test_per_play=2)


@functools.cache
def _pool(seed=0, **kw):
    return selection.make_shakespeare_pool(seed, **{**_SIZES, **kw})


def _decode(p, rows):
    return ["".join(p.vocab[c] for c in row) for row in rows]


def test_splits_are_disjoint_passages_of_the_folio_and_targets_are_the_genre():
    p = _pool()
    per = sum(v for k, v in _SIZES.items() if k != "seq_len")
    ds = data.load_shakespeare(label="play", passage_chars=25, max_passages_per_play=per)
    play_of = {s: ds.class_names[y] for s, y in zip(ds.x, ds.y, strict=True)}
    clean = p.pool_x[p.pool_kind != 1]
    splits = [_decode(p, x) for x in (p.pretrain_x, clean, p.val_x, p.test_x)]
    every = [s for split in splits for s in split]
    assert all(s in play_of for s in every)  # decoding gives back the loader's passages
    assert not Counter(every) - Counter(ds.x)  # no passage in two splits (or twice in one)
    histories = tuple(k for k in ds.class_names if PLAYS[k][0] == "history")
    assert p.subtasks == histories
    # Validation passages come from their subtask's play; test passages from target plays.
    val_plays = [play_of[s] for s in splits[2]]
    assert val_plays == [p.subtasks[i] for i in p.val_subtask]
    assert np.bincount(p.val_subtask).tolist() == [2] * len(histories)
    assert {play_of[s] for s in splits[3]} == set(histories)
    # Pool kinds: 0 exactly the target genre's clean passages, 2 the others.
    kinds = [0 if play_of[s] in histories else 2 for s in splits[1]]
    assert kinds == p.pool_kind[p.pool_kind != 1].tolist()
    n = 35 * _SIZES["pool_per_play"]
    assert p.pool_x.shape == (n + round(0.1 * n), 25) and p.pool_x.dtype == np.int32
    assert (p.pool_kind[n:] == 1).all() and p.pretrain_x.shape == (35 * 3, 25)


def test_distractors_are_corrupted_copies_of_pool_passages():
    exact = _pool(corrupt_fraction=0.0)
    clean = {tuple(r) for r in exact.pool_x[exact.pool_kind != 1]}
    assert all(tuple(r) in clean for r in exact.pool_x[exact.pool_kind == 1])
    p = _pool()
    np.testing.assert_array_equal(p.pool_x[p.pool_kind != 1], exact.pool_x[exact.pool_kind != 1])
    clean = p.pool_x[p.pool_kind != 1]
    hamming = [np.min(np.mean(clean != r, axis=1)) for r in p.pool_x[p.pool_kind == 1]]
    # About 30% of the characters replaced (a replacement may draw the same character).
    assert 0.15 < np.mean(hamming) < 0.45 and min(hamming) > 0


def test_the_seed_reshuffles_and_other_genres_can_be_the_target():
    a, b = _pool(), _pool(seed=1)
    assert a.vocab == b.vocab and not np.array_equal(a.pool_x, b.pool_x)
    np.testing.assert_array_equal(a.pool_x, _pool.__wrapped__(0, **_SIZES).pool_x)
    t = _pool(target_genre="tragedy")
    assert len(t.subtasks) == 11 and all(PLAYS[k][0] == "tragedy" for k in t.subtasks)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0}, "seq_len=0 is invalid"),
        ({"val_per_play": 1.5}, "val_per_play=1.5 is invalid"),
        ({"distractor_fraction": 1.2}, "distractor_fraction=1.2 is invalid"),
        ({"target_genre": "poem"}, "target_genre='poem' is invalid"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        selection.make_shakespeare_pool(0, **kwargs)
