r"""The image datasets of the pre-trained-ViT continual benchmarks, read from TFDS on demand.

:func:`tfds_image_source` opens ``cifar100``, ``imagenet_r`` or ``domainnet`` (its six domains
together) through ``tfds.data_source``, the random-access (ArrayRecord) reader of TFDS, which
needs no TensorFlow (TensorFlow is not installed here, so ``tf.data`` is not an option; ``grain``
is not installed either). An :class:`ImageSource` keeps only the labels and where each example
lives; images are read and decoded when a batch asks for them, so no dataset is held in memory.
:class:`~lowrank_jax.data.image_readers.ImageBatches` is a resumable iterator (``state`` / ``restore``, as
:class:`~lowrank_jax.data.BatchIterator`, whose order it uses) of transformed batches
(:mod:`lowrank_jax.data.image_transforms`), whose augmentation is drawn from a generator seeded
by ``(seed, epoch, position)``, so a resumed run sees the very batches it would have seen.
Class-incremental tasks come from :func:`lowrank_jax.data.incremental.split_by_classes` over
:meth:`ImageSource.index` (a ``Dataset`` of row ids; the same ``seed`` orders the classes of the
train and the test split alike)::

    train = data.tfds_image_source("imagenet_r", split="train")
    tasks = split_by_classes(train.index(), classes_per_task=20, seed=0)   # 10 tasks
    batches = data.ImageBatches(train, tasks[0], batch_size=128, seed=0,
                                transform=data.train_transform(224))
    batch = next(batches)        # {"x": (128, 224, 224, 3) float32, "y": (128,) int32}

Labels: CIFAR-100's 100 and DomainNet's 345 classes as TFDS gives them; ImageNet-R's labels
live in the ImageNet-1k space and are mapped to ``0..199`` by the table of
:mod:`lowrank_jax.data.imagenet_r_classes`.

**ImageNet-R's split.** TFDS has one split of ImageNet-R (``test``, 30,000 images); the
class-incremental literature trains on 80% and tests on 20% of it. The split of InfLoRA's and
CODA-Prompt's repositories is a folder layout that cannot be stored without the images, so this
one is made by a rule over the example ids (TFDS's ``file_name``, ``"<wnid>/<file>.jpg"``):
an image is a test image when

    u = int(sha256(f"imagenet_r/{seed}/{file_name}")[:8 bytes], big-endian) / 2**64 < 0.2

(``seed=0`` by default). The rule needs no other example, so it does not depend on the order
or the completeness of a prepared copy; per class the test share is 20% up to sampling noise
(binomial, about ±3% for a class of 150 images). ``tests/data/test_tfds_images.py`` pins its
value on fixed ids so that it cannot drift.

**Cost.** Opening a source reads every example once for its label (TFDS decodes the image too;
a partial decoding needs TensorFlow): CIFAR-100's 60,000 small PNGs take seconds, ImageNet-R's
30,000 JPEGs about a minute, DomainNet's ~590,000 many minutes on ``num_threads`` threads.
``cache_dir`` keeps the labels (and ImageNet-R's ids) in a small ``.npz`` per split, read instead
on later runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from lowrank_jax.data.imagenet_r_classes import IMAGENET_R_CLASSES
from lowrank_jax.data.records import Dataset
from lowrank_jax.data.tfds_source import open_data_source

__all__ = [
    "DOMAINNET_DOMAINS",
    "IMAGE_DATASETS",
    "ImageSource",
    "imagenet_r_is_test",
    "tfds_image_source",
]

IMAGE_DATASETS = ("cifar100", "domainnet", "imagenet_r")
# TFDS's domainnet configs, in the order of InfLoRA's `iDomainNet.domain_names`.
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSource:
    """Labelled images of one or more TFDS data sources, read on demand.

    Row ``i`` is record ``record[i]`` of ``parts[part[i]]``; its label is ``labels[i]``.

    Attributes:
      parts: the TFDS data sources (``source[k]`` a dict of NumPy features).
      part: ``(N,)`` the part of each row.
      record: ``(N,)`` the record of each row in its part.
      labels: ``(N,)`` ``int32`` class ids into ``class_names``.
      class_names: the classes.
      image_key: the feature that holds the image.
      num_threads: threads that decode a batch's images (1: none).
    """

    parts: tuple[Any, ...]
    part: np.ndarray
    record: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]
    image_key: str = "image"
    num_threads: int = 8

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def index(self) -> Dataset:
        """The rows as a ``Dataset`` (``x`` the row ids ``0..N-1``, ``y`` the labels): the
        input of ``split_by_classes`` and of :class:`ImageBatches`."""
        return Dataset(np.arange(len(self)), self.labels, self.class_names)

    def image(self, row: int) -> np.ndarray:
        """The ``uint8`` ``(H, W, C)`` image of ``row``, read and decoded."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} is not in [0, {len(self)}).")
        example = self.parts[int(self.part[row])][int(self.record[row])]
        return np.asarray(example[self.image_key])


def imagenet_r_is_test(file_names: Sequence[str], *, seed: int = 0, test_fraction: float = 0.2):
    """Whether each ImageNet-R example is in the test part of the 80/20 split (module docstring).

    Args:
      file_names: TFDS's ``file_name`` of each example (``"<wnid>/<file>.jpg"``).
      seed: the split's seed.
      test_fraction: the expected test share.

    Returns:
      ``(N,)`` bool.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1); got {test_fraction!r}.")
    u = [
        int.from_bytes(hashlib.sha256(f"imagenet_r/{seed}/{name}".encode()).digest()[:8], "big")
        for name in file_names
    ]
    return np.asarray(u, np.float64) / 2.0**64 < test_fraction


def _text(value: Any) -> str:
    value = value.item() if isinstance(value, np.ndarray) else value
    return value.decode() if isinstance(value, bytes) else str(value)


def _scan(source: Any, keys: Sequence[str], num_threads: int) -> dict[str, np.ndarray]:
    """``{key: (n,) values}`` of the non-image features ``keys`` of every record."""

    def one(i: int) -> tuple:
        example = source[i]
        return tuple(example[k] for k in keys)

    n = len(source)
    if num_threads > 1:
        with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
            rows = list(pool.map(one, range(n), chunksize=256))
    else:
        rows = [one(i) for i in range(n)]
    out = {}
    for j, k in enumerate(keys):
        values = [r[j] for r in rows]
        out[k] = (
            np.asarray([int(v) for v in values], np.int64)
            if k == "label"
            else np.asarray([_text(v) for v in values], dtype=object)
        )
    return out


def _scan_cached(
    source: Any, name: str, split: str, keys: Sequence[str], cache_dir, num_threads: int
) -> dict[str, np.ndarray]:
    if cache_dir is None:
        return _scan(source, keys, num_threads)
    full = getattr(source.dataset_info, "full_name", name).replace("/", "_")
    file = os.path.join(os.fspath(cache_dir), f"{full}_{split}_{'_'.join(keys)}.npz")
    if os.path.isfile(file):
        with np.load(file, allow_pickle=False) as f:
            if int(f["n"]) == len(source):
                return {k: f[k] if k == "label" else f[k].astype(object) for k in keys}
    out = _scan(source, keys, num_threads)
    os.makedirs(os.fspath(cache_dir), exist_ok=True)
    arrays = {k: v if k == "label" else v.astype(str) for k, v in out.items()}
    np.savez(file, n=len(source), **arrays)
    return out


def _names(source: Any, label_key: str) -> tuple[str, ...]:
    return tuple(source.dataset_info.features[label_key].names)


def tfds_image_source(
    name: str,
    *,
    split: str,
    data_dir: str | os.PathLike | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
    domains: Sequence[str] = DOMAINNET_DOMAINS,
    cache_dir: str | os.PathLike | None = None,
    num_threads: int = 8,
) -> ImageSource:
    """One split of CIFAR-100, ImageNet-R or DomainNet from prepared TFDS data, read on demand.

    * ``cifar100``: TFDS's ``train`` (50,000) / ``test`` (10,000), 100 classes.
    * ``imagenet_r``: the 80/20 split of TFDS's only split (module docstring), the labels mapped
      to the 200 ImageNet-R classes (examples of other labels, which the real dataset does not
      have, are left out).
    * ``domainnet``: TFDS's ``domainnet/<domain>`` ``train`` / ``test`` (DomainNet's own
      split) of ``domains``, concatenated in that order, 345 classes.

    Args:
      name: one of ``IMAGE_DATASETS``.
      split: ``"train"`` or ``"test"``.
      data_dir: the TFDS data directory holding the prepared (``array_record``) datasets.
      seed, test_fraction: ImageNet-R's split (:func:`imagenet_r_is_test`).
      domains: DomainNet's domains to use.
      cache_dir: where to keep the labels between runs (None: read them each time).
      num_threads: threads that read labels and decode images.

    Returns:
      An :class:`ImageSource`.

    Raises:
      ValueError: an unknown name, split or domain.
      FileNotFoundError: a dataset that is not prepared (the message gives the command).
    """
    if name not in IMAGE_DATASETS:
        raise ValueError(f"name={name!r} is not one of {IMAGE_DATASETS}.")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}.")
    threads = int(num_threads)
    if name == "imagenet_r":
        source = open_data_source("imagenet_r", split="test", data_dir=data_dir)
        meta = _scan_cached(source, name, "test", ("label", "file_name"), cache_dir, threads)
        to_200 = np.full(1000, -1, np.int64)
        to_200[[i for i, _ in IMAGENET_R_CLASSES]] = np.arange(len(IMAGENET_R_CLASSES))
        labels = to_200[meta["label"]]
        is_test = imagenet_r_is_test(meta["file_name"], seed=seed, test_fraction=test_fraction)
        keep = np.flatnonzero((labels >= 0) & (is_test == (split == "test")))
        if (labels < 0).any():
            logging.info("imagenet_r: %d examples outside the 200 classes", int((labels < 0).sum()))
        names = tuple(w for _, w in IMAGENET_R_CLASSES)
        return ImageSource(
            (source,),
            np.zeros_like(keep),
            keep,
            labels[keep].astype(np.int32),
            names,
            num_threads=threads,
        )
    if name == "cifar100":
        parts = [open_data_source("cifar100", split=split, data_dir=data_dir)]
        tfds_names = ["cifar100"]
    else:
        unknown = sorted(set(domains) - set(DOMAINNET_DOMAINS))
        if unknown or not domains:
            raise ValueError(
                f"domains must be a non-empty subset of {DOMAINNET_DOMAINS}; got {domains!r}."
            )
        tfds_names = [f"domainnet/{d}" for d in domains]
        parts = [open_data_source(n, split=split, data_dir=data_dir) for n in tfds_names]
    labels, part, record = [], [], []
    for k, (source, tfds_name) in enumerate(zip(parts, tfds_names, strict=True)):
        meta = _scan_cached(source, tfds_name, split, ("label",), cache_dir, threads)
        labels.append(meta["label"])
        part.append(np.full(len(source), k))
        record.append(np.arange(len(source)))
    return ImageSource(
        tuple(parts),
        np.concatenate(part),
        np.concatenate(record),
        np.concatenate(labels).astype(np.int32),
        _names(parts[0], "label"),
        num_threads=threads,
    )
