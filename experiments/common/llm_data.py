"""The data sources of ``experiments/llm_sft.py``: JSONL files or TFDS datasets, one or several.

``config.data.train`` (and ``.valid``) is a comma-separated list of sources; a source is a JSONL
file (rows ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages"}``,
:mod:`lowrank_jax.data.text`) or ``tfds:NAME[@SPLIT]`` (``tfds:imdb_reviews@train[:2000]``; split
``train`` when omitted), read with ``tfds.data_source`` (a prepared dataset in TFDS's
``array_record`` format; no TensorFlow needed) and turned into ``{"text"}`` rows from the
feature ``data.tfds_text``, or ``{"prompt", "completion"}`` rows from ``data.tfds_prompt`` and
``data.tfds_completion`` when both are set; ``data.tfds_max_rows`` caps the rows read (0: all).
Several training sources are the tasks of a continual run (``continual.method``), one per
source; without a valid source each task holds out a seeded ``data.valid_fraction`` of its rows.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from experiments import common
from lowrank_jax import data

TFDS = "tfds:"


def sources(value: str) -> list[str]:
    """The comma-separated sources of ``value`` (``""``: none)."""
    return [s.strip() for s in value.split(",") if s.strip()]


def check_sources(config: Any) -> None:
    """Raises ``common.ConfigError`` for a missing file, a TFDS source without its text feature,
    or valid sources that do not pair with the training sources."""
    for key in ("train", "valid"):
        for src in sources(config.data[key]):
            if not src.startswith(TFDS) and not os.path.isfile(src):
                raise common.ConfigError(f"config.data.{key}={src!r} is invalid: no such file")
    if any(s.startswith(TFDS) for k in ("train", "valid") for s in sources(config.data[k])):
        d = config.data
        if not d.tfds_text and not (d.tfds_prompt and d.tfds_completion):
            raise common.ConfigError(
                "a tfds: source needs config.data.tfds_text (the text feature) or both "
                "config.data.tfds_prompt and config.data.tfds_completion"
            )
    common.check_nonnegative(config, "data.tfds_max_rows", integer=True)
    train, valid = sources(config.data.train), sources(config.data.valid)
    if valid and len(valid) != len(train):
        raise common.ConfigError(
            f"config.data.valid names {len(valid)} sources for {len(train)} training sources: "
            "pass one valid source per training source, or none (held out of each)"
        )
    if len(train) > 1 and not config.continual.method:
        raise common.ConfigError(
            f"config.data.train names {len(train)} sources: several sources are the tasks of a "
            "continual run; pass --config.continual.method=saber (or gr_lora, o_lora, inflora, "
            "sd_lora, sequential), or one source"
        )


def tfds_rows(config: Any, source: str) -> list[dict[str, str]]:
    """The rows of ``tfds:NAME[@SPLIT]`` as ``{"text"}`` or ``{"prompt", "completion"}`` dicts."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            f"{source} needs tensorflow_datasets: pip install tensorflow-datasets"
        ) from e
    name, _, split = source.removeprefix(TFDS).partition("@")
    ds = tfds.data_source(name, split=split or "train")
    d = config.data
    n = len(ds) if not d.tfds_max_rows else min(len(ds), d.tfds_max_rows)

    def as_text(value: Any) -> str:
        value = value.item() if isinstance(value, np.ndarray) else value
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    rows = []
    for i in range(n):
        ex = ds[i]
        if d.tfds_prompt and d.tfds_completion:
            rows.append(
                {"prompt": as_text(ex[d.tfds_prompt]), "completion": as_text(ex[d.tfds_completion])}
            )
        else:
            rows.append({"text": as_text(ex[d.tfds_text])})
    return rows


def read_examples(config: Any, tokenizer: data.Tokenizer, source: str) -> list:
    """``text.Example`` s of one source (a JSONL file's bad row fails naming file and line)."""
    if not source.startswith(TFDS):
        return data.encode_jsonl(tokenizer, source)
    out = []
    for i, row in enumerate(tfds_rows(config, source)):
        try:
            out.append(data.text.encode_row(tokenizer, row))
        except ValueError as e:
            raise ValueError(f"{source} row {i}: {e}") from e
    return out


def split_examples(config: Any, tokenizer: data.Tokenizer, train: str, valid: str) -> tuple:
    """``(train, valid)`` examples of one task; without ``valid``, a seeded
    ``data.valid_fraction`` of the training rows (at least one) is held out."""
    rows = read_examples(config, tokenizer, train)
    if valid:
        return rows, read_examples(config, tokenizer, valid)
    if len(rows) < 2:
        raise ValueError(f"{train} has one row: add rows or pass --config.data.valid.")
    order = np.random.default_rng(config.seed).permutation(len(rows))
    n = min(len(rows) - 1, max(1, round(config.data.valid_fraction * len(rows))))
    return [rows[i] for i in sorted(order[n:])], [rows[i] for i in sorted(order[:n])]


def load_tasks(config: Any, tokenizer: data.Tokenizer, files: dict[str, str]) -> list[tuple]:
    """``[(name, train, valid)]``, one per training source of ``files["train"]``."""
    train, valid = sources(files["train"]), sources(files["valid"])
    valid = valid or [""] * len(train)
    return [
        (
            os.path.basename(t) if not t.startswith(TFDS) else t,
            *split_examples(config, tokenizer, t, v),
        )
        for t, v in zip(train, valid, strict=True)
    ]
