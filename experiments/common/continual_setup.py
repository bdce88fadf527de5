"""Task streams and frozen backbones of the continual-learning experiment (``continual.py``).

Benchmarks (``config.data.benchmark``, seeded; built by :mod:`lowrank_jax.continual.streams`):

* ``split_digits`` (task-incremental, specs §1 (4)): five 10-class digit tasks made conflicting
  (task 0 plain, odd tasks pixel-permuted, even tasks ``≥ 2`` label-permuted; task ``t`` owns
  classes ``10t .. 10t+9``); an MLP pretrained on digits 0–4.
* ``digits_cil`` (class-incremental, specs §2 sanity check): digits in 5 tasks × 2 classes on a
  random-feature MLP.
* ``long_stream`` (class-incremental, specs §2 (4)): 20 tasks × 5 Gaussian classes whose means
  share a 32-d subspace of R^64; a random-feature MLP.
* ``shakespeare_plays`` (class-incremental): passages of Shakespeare's First Folio labelled by
  play, ``data.plays_per_task`` plays per task (the task order is shuffled per seed), on the real
  pretrained all-MiniLM-L6-v2. The encoder is frozen; its bottom layers ``0 .. first_layer-1``
  run once and their hidden states are the stream's inputs (cached per process); the top layers,
  mean pooling and a linear head form the model that the adapters train
  (:class:`lowrank_jax.models.bert.BertTopClassifier`).
* ``split_mnist`` (class-incremental, base + increments): a base session trains a small ViT from
  scratch on MNIST digits 0–4; task 0 is that session's classes (its head rows are kept) and the
  increments split digits 5–9 (in a per-seed order) into ``num_tasks - 1`` groups of ≥ 2 classes,
  learned with the frozen backbone plus adapters.
* ``mnist_cil`` (class-incremental, the stronger benchmark of issue 16): all ten MNIST digits in
  ``num_tasks`` tasks (default 5 × 2 classes, a per-seed class order), ``train_per_class``
  training images per digit and the full MNIST test set of each task's digits, on a ViT whose
  base session is all 60,000 Fashion-MNIST images (10 clothing classes; the head is thrown away).
  The backbone is pretrained but has seen no digit, so every class is incremental: unlike
  ``split_mnist``, task 0 is not the pretraining task. Needs the Debian package
  ``dataset-fashion-mnist``.

* ``cifar100_10``, ``imagenet_r_5``, ``imagenet_r_10``, ``imagenet_r_20``, ``domainnet_5``
  (class-incremental, the pre-trained-ViT papers' benchmarks: InfLoRA, SD-LoRA): equal tasks of
  TFDS's CIFAR-100, ImageNet-R (its 80/20 split) or DomainNet, read on demand
  (:func:`lowrank_jax.continual.image_cil`; ``config.data.data_dir`` holds the prepared data) on
  a Hugging Face ViT checkpoint (``config.model.checkpoint``: ViT-B/16 pre-trained on
  ImageNet-21k for the papers' numbers) with a fresh head over all classes.

Backbones: :mod:`experiments.common.continual_backbones`. Hyper-parameter search:
:func:`validation_stream` carves a per-class validation split from each
task's training rows (``config.data.valid_fraction``); :mod:`experiments.common.continual_search`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
from absl import logging

from experiments import common
from experiments.common.continual_backbones import MODELS, minilm_config, vit_b16
from lowrank_jax import continual, data, models
from lowrank_jax.continual.image_benchmarks import IMAGE_BENCHMARKS
from lowrank_jax.continual.streams import class_incremental_stream
from lowrank_jax.data.shakespeare import PLAYS
from lowrank_jax.models.bert_prefix import encode_prefix
from lowrank_jax.models.hf_vit import preprocessing

PROTOCOLS = {  # benchmark: its protocol (task- or class-incremental)
    "split_digits": "til",
    "digits_cil": "cil",
    "long_stream": "cil",
    "shakespeare_plays": "cil",
    "split_mnist": "cil",
    "mnist_cil": "cil",
    **{name: "cil" for name in IMAGE_BENCHMARKS},
}
BENCHMARKS = tuple(PROTOCOLS)
DATASET_CLASSES = {"cifar100": 100, "imagenet_r": 200, "domainnet": 345}


# The stream record of the library (kept under its old name for the experiment modules).
Stream = continual.TaskStream


def check_setup(config: Any) -> None:
    """Validates the stream and backbone keys (``data.*``, ``model.*``) of ``config``.

    Raises:
      experiments.common.ConfigError: naming the first bad key, its value and what is allowed.
    """
    c = common
    benchmark = c.check_choice(config, "data.benchmark", BENCHMARKS)
    c.check_positive(config, "data.batch_size", integer=True)
    c.check_positive(config, "data.num_tasks", integer=True)
    if benchmark == "long_stream":
        c.check_positive(config, "data.classes_per_task", integer=True)
        c.check_positive(config, "data.separation")
    if benchmark == "shakespeare_plays":
        for key in ("plays_per_task", "passage_chars", "seq_len", "train_per_class"):
            c.check_positive(config, f"data.{key}", integer=True)
        c.check_positive(config, "data.test_per_class", integer=True)
        plays = c.get_path(config, "data.plays")
        unknown = sorted(set(plays) - set(PLAYS)) if not isinstance(plays, str) else [plays]
        if unknown or len(set(plays)) != len(plays):
            raise c.ConfigError(
                f"config.data.plays={plays!r} is invalid: distinct play keys from "
                f"{', '.join(PLAYS)}"
            )
        if config.data.plays_per_task < 2:
            raise c.ConfigError("config.data.plays_per_task must be >= 2 (a task needs 2 classes)")
        need = config.data.plays_per_task * config.data.num_tasks
        if len(plays) < need:
            raise c.ConfigError(
                f"config.data.plays has {len(plays)} plays; {config.data.num_tasks} tasks x "
                f"{config.data.plays_per_task} plays per task need {need}: add plays or lower "
                "config.data.num_tasks"
            )
        if config.data.seq_len > 512:
            raise c.ConfigError(
                f"config.data.seq_len={config.data.seq_len} is invalid: MiniLM takes <= 512 tokens"
            )
    if benchmark == "mnist_cil":
        c.check_positive(config, "data.train_per_class", integer=True)
        if not 2 <= config.data.num_tasks <= 5:
            raise c.ConfigError(
                f"config.data.num_tasks={config.data.num_tasks} is invalid for mnist_cil: 2..5 "
                "(ten digits, each task needs >= 2 classes)"
            )
    if benchmark == "split_mnist":
        c.check_positive(config, "data.train_per_class", integer=True)
        if config.data.num_tasks not in (2, 3):
            raise c.ConfigError(
                f"config.data.num_tasks={config.data.num_tasks} is invalid for split_mnist: the "
                "base session (0-4) plus 1 or 2 increments over 5-9 (each needs >= 2 classes)"
            )
    if benchmark in IMAGE_BENCHMARKS:
        c.check_nonnegative(config, "data.classes_per_task", integer=True)
        checkpoint = c.get_path(config, "model.checkpoint")  # "": ViT-B/16's shapes, no run
        if checkpoint and not os.path.isfile(os.path.join(checkpoint, "config.json")):
            raise c.ConfigError(
                f"config.model.checkpoint={checkpoint!r} is not a Hugging Face ViT checkpoint "
                "directory (config.json, model.safetensors): save google/vit-base-patch16-224-"
                "in21k with save_pretrained and pass --config.model.checkpoint=DIR"
            )
    name = c.check_choice(config, "model.name", MODELS)
    wanted = {"shakespeare_plays": "minilm", "split_mnist": "vit", "mnist_cil": "vit"}
    wanted = "vit_b16" if benchmark in IMAGE_BENCHMARKS else wanted.get(benchmark, "mlp")
    if name != wanted:
        raise c.ConfigError(
            f"config.model.name={name!r} does not fit benchmark {benchmark!r}: use {wanted!r}"
        )
    if name == "mlp":
        c.check_positive_ints(config, "model.features")
    if name == "vit":
        for key in ("patch", "dim", "depth", "heads", "mlp_dim"):
            c.check_positive(config, f"model.vit.{key}", integer=True)
        c.check_divisible(config, "model.vit.dim", config.model.vit.heads, why="heads split dim")
    if name == "minilm":
        first = c.get_path(config, "model.first_layer")
        if isinstance(first, bool) or not isinstance(first, int) or not 1 <= first <= 5:
            raise c.ConfigError(
                f"config.model.first_layer={first!r} is invalid: the first adapted MiniLM layer, "
                "1..5 (layers below it are frozen and cached)"
            )
    c.check_nonnegative(config, "model.pretrain_steps", integer=True)
    frac = c.get_path(config, "data.valid_fraction")
    if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 < frac <= 0.5:
        raise c.ConfigError(
            f"config.data.valid_fraction={frac!r} is invalid: the validation share of each "
            "class's training rows, in (0, 0.5]"
        )
    c.check_nonnegative(config, "search.trials", integer=True)
    c.check_nonnegative(config, "search.seed", integer=True)


# ----------------------------------------------------------------------------------------------
# Streams.


def _digits_splits(seed: int) -> tuple[Any, Any]:
    ds = data.load_digits()
    splits = data.split(ds, seed=seed, valid_fraction=0.0001, test_fraction=0.25)
    train = data.Dataset(
        np.concatenate([splits.train.x, splits.valid.x]),
        np.concatenate([splits.train.y, splits.valid.y]),
        ds.class_names,
    )
    return train, splits.test


def load_stream(config: Any, seed: int) -> Stream:
    """Builds the benchmark's stream (deterministic in ``seed``); see the module docstring."""
    rng = np.random.default_rng(1000 + seed)
    bench = config.data.benchmark
    num_tasks = config.data.num_tasks
    if bench == "long_stream":
        pairs, _ = continual.long_stream(
            seed=seed,
            num_tasks=num_tasks,
            classes_per_task=config.data.classes_per_task,
            dim=config.data.dim,
            subspace_dim=config.data.subspace_dim,
            train_per_class=config.data.train_per_class,
            test_per_class=config.data.test_per_class,
            separation=config.data.separation,
        )
        k = config.data.classes_per_task
        tasks = [
            {"train": {"x": tr.x, "y": tr.y}, "test": {"x": te.x, "y": te.y}} for tr, te in pairs
        ]
        classes = [np.arange(t * k, (t + 1) * k) for t in range(num_tasks)]
        return Stream(tasks, classes, num_tasks * k, "cil", None, 0)
    if bench == "shakespeare_plays":
        return _shakespeare_stream(config, rng)
    if bench in IMAGE_BENCHMARKS:
        if not config.model.checkpoint:
            raise common.ConfigError(
                f"config.model.checkpoint is empty: {bench} runs on a Hugging Face ViT "
                "checkpoint: save google/vit-base-patch16-224-in21k with save_pretrained and pass "
                "--config.model.checkpoint=DIR"
            )
        d, pre = config.data, preprocessing(config.model.checkpoint)
        return continual.image_cil(
            bench,
            image_size=pre.size[0],
            mean=pre.mean,
            std=pre.std,
            shuffle=d.shuffle_classes,
            seed=seed,
            num_tasks=num_tasks,
            classes_per_task=d.classes_per_task or None,
            data_dir=d.data_dir or None,
        )
    if bench in ("split_mnist", "mnist_cil"):
        train, test = data.load_mnist("train"), data.load_mnist("test")
        per_class = dict(num_tasks=num_tasks, train_per_class=config.data.train_per_class)
        if bench == "split_mnist":
            return continual.split_mnist(train, test, **per_class, seed=rng)
        fashion = data.load_fashion_mnist("train")  # every digit is incremental
        return continual.mnist_cil(train, test, fashion, **per_class, seed=rng)
    train, test = _digits_splits(seed)
    if bench == "digits_cil":
        if 10 % num_tasks:
            raise common.ConfigError(
                f"config.data.num_tasks={num_tasks} must divide the 10 digit classes (2 or 5)"
            )
        return continual.digits_cil(train, test, num_tasks=num_tasks, seed=rng)
    # split_digits: conflicting digit tasks, one 10-class head block per task.
    return continual.split_digits(train, test, num_tasks=num_tasks, seed=rng)


@functools.lru_cache(maxsize=1)
def _minilm_hidden(
    plays: tuple[str, ...], passage_chars: int, per_play: int, seq_len: int, first_layer: int
) -> tuple[np.ndarray, np.ndarray]:
    """Hidden states after MiniLM layer ``first_layer - 1`` of ``per_play`` passages per play.

    Passages are tokenised to exactly ``seq_len`` word pieces (truncated); any that would need
    padding is dropped, so the top layers need no attention mask. Returns ``(hidden (N, seq_len,
    d) float32, y (N,))`` with ``y`` the index into ``plays``.
    """
    bert_config, variables, tokenizer = models.load_minilm()
    ds = data.load_shakespeare(
        label="play", plays=list(plays), passage_chars=passage_chars, max_passages_per_play=per_play
    )
    order = {name: i for i, name in enumerate(plays)}
    y = np.asarray([order[ds.class_names[c]] for c in ds.y], np.int32)
    batch = models.tokenize(tokenizer, list(ds.x), max_len=seq_len)
    full = batch["attention_mask"].all(axis=1)
    ids, y = batch["input_ids"][full], y[full]
    logging.info(
        "shakespeare_plays: encoding %d passages (%d dropped as shorter than %d tokens) with "
        "MiniLM layers 0..%d",
        len(ids),
        int(np.sum(~full)),
        seq_len,
        first_layer - 1,
    )
    return encode_prefix(bert_config, variables, ids, first_layer=first_layer), y


def stream_shapes(config: Any) -> dict[str, Any]:
    """What :func:`load_stream` and :func:`build_backbone` give, without loading data:
    ``{"x": the shape of one example, "num_classes", "task_classes": task 0's classes,
    "protocol", "base": (shape of a base-session example, its classes) or None}``."""
    d, bench = config.data, config.data.benchmark
    if bench in IMAGE_BENCHMARKS:
        _, shape = vit_b16(config, 0)
        classes = DATASET_CLASSES[continual.image_benchmarks.IMAGE_BENCHMARKS[bench].dataset]
        per_task = d.classes_per_task or classes // d.num_tasks
        return {
            "x": shape,
            "num_classes": classes,
            "task_classes": np.arange(per_task),
            "protocol": "cil",
            "base": None,
        }
    digits = ((64,), None)
    x, base = {
        "split_digits": digits,
        "digits_cil": digits,
        "long_stream": ((d.dim,), None),
        "shakespeare_plays": ((d.seq_len, minilm_config().hidden_size), None),
        "split_mnist": ((28, 28, 1), ((28, 28, 1), 5)),
        "mnist_cil": ((28, 28, 1), ((28, 28, 1), 10)),
    }[bench]
    num_classes, per_task = {
        "split_digits": (10 * d.num_tasks, 10),
        "digits_cil": (10, 10 // d.num_tasks),
        "long_stream": (d.num_tasks * d.classes_per_task, d.classes_per_task),
        "shakespeare_plays": (len(d.plays), d.plays_per_task),
        "split_mnist": (10, 5),
        "mnist_cil": (10, 10 // d.num_tasks),
    }[bench]
    if bench == "split_digits":
        base = ((64,), 5)
    if not config.model.pretrain_steps:
        base = None
    return {
        "x": x,
        "num_classes": num_classes,
        "task_classes": np.arange(per_task),
        "protocol": PROTOCOLS[bench],
        "base": base,
    }


def _shakespeare_stream(config: Any, rng: np.random.Generator) -> Stream:
    d = config.data
    plays = tuple(d.plays)
    per_play = d.train_per_class + d.test_per_class
    hidden, y = _minilm_hidden(
        plays, d.passage_chars, per_play, d.seq_len, config.model.first_layer
    )
    counts = np.bincount(y, minlength=len(plays))
    for c in np.flatnonzero(counts < per_play)[:1]:
        raise common.ConfigError(
            f"play {plays[c]!r} has only {counts[c]} passages of {d.seq_len} word pieces, "
            f"fewer than config.data.train_per_class + test_per_class = {per_play}: lower "
            "them or config.data.seq_len, raise config.data.passage_chars, or pick other plays"
        )
    # a fixed train/test split per play (the same for every seed); the task order is per seed
    return class_incremental_stream(
        hidden,
        y,
        num_classes=len(plays),
        num_tasks=d.num_tasks,
        classes_per_task=d.plays_per_task,
        test_per_class=d.test_per_class,
        seed=rng,
    )
