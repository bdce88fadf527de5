r"""The class-incremental image benchmarks of the pre-trained-ViT papers, read on demand.

InfLoRA, SD-LoRA and the methods they compare with (P1 SABER's and P2 GR-LoRA's setting) learn
CIFAR-100 in 10 tasks, ImageNet-R in 5, 10 and 20 tasks and DomainNet in 5 tasks of equal
classes on a ViT-B/16 pre-trained on ImageNet-21k. :func:`image_cil` builds those streams from
prepared TFDS data (:func:`lowrank_jax.data.tfds_image_source`) with no image held in memory:
every split's ``"x"`` is a :class:`lowrank_jax.data.ImageRows` (the evaluation transform of the
checkpoint's size and normalisation), which the continual methods, their heads and
:func:`~lowrank_jax.continual.evaluate_stream` read a batch at a time; training batches, with
InfLoRA's augmentation, come from :func:`train_batches`::

    stream = continual.image_cil("imagenet_r_10", image_size=224, mean=pre.mean, std=pre.std)
    for t in range(len(stream.tasks)):
        batches = continual.train_batches(stream, t, batch_size=128, seed=t)  # {"x", "y"}
        ...

**Class order.** PyCIL's (InfLoRA's and SD-LoRA's code base): with ``shuffle`` the classes are
``numpy.random.seed(seed); numpy.random.permutation(C)``, which :func:`class_order` reproduces
(``RandomState(seed)`` draws the same permutation as the legacy global seed); without it they
stay in ascending id order (InfLoRA's public configurations set ``shuffle: false``; SD-LoRA's
ImageNet-R configuration sets ``shuffle: true``, ``seed: 1995``). Class ids are TFDS's
(CIFAR-100 and DomainNet) or the 200 ImageNet-R classes in ascending ImageNet-1k index, which is
the sorted-wnid order of the folder layout those repositories read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from lowrank_jax.continual.streams import TaskStream
from lowrank_jax.data.image_readers import ImageBatches, ImageRows
from lowrank_jax.data.image_transforms import eval_transform, train_transform
from lowrank_jax.data.tfds_images import tfds_image_source

__all__ = ["IMAGE_BENCHMARKS", "ImageBenchmark", "class_order", "image_cil", "train_batches"]


@dataclasses.dataclass(frozen=True)
class ImageBenchmark:
    """One benchmark: its TFDS dataset, its number of equal tasks and its test-time crop.

    Attributes:
      dataset: one of :data:`lowrank_jax.data.tfds_images.IMAGE_DATASETS`.
      num_tasks: tasks of ``C / num_tasks`` classes each.
      crop_fraction: the evaluation transform's centre crop (1 for CIFAR-100's ``Resize``).
    """

    dataset: str
    num_tasks: int
    crop_fraction: float = 224 / 256


IMAGE_BENCHMARKS = {
    "cifar100_10": ImageBenchmark("cifar100", 10, 1.0),
    "imagenet_r_5": ImageBenchmark("imagenet_r", 5),
    "imagenet_r_10": ImageBenchmark("imagenet_r", 10),
    "imagenet_r_20": ImageBenchmark("imagenet_r", 20),
    "domainnet_5": ImageBenchmark("domainnet", 5),
}


def class_order(num_classes: int, *, shuffle: bool, seed: int) -> np.ndarray:
    """PyCIL's class order: ``RandomState(seed).permutation(C)`` with ``shuffle``, else ``0..C-1``."""
    if shuffle:
        return np.random.RandomState(seed).permutation(num_classes)
    return np.arange(num_classes)


def image_cil(
    name: str,
    *,
    image_size: int = 224,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    shuffle: bool = False,
    seed: int = 0,
    split_seed: int = 0,
    num_tasks: int | None = None,
    classes_per_task: int | None = None,
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    num_threads: int = 8,
) -> TaskStream:
    """The class-incremental stream of benchmark ``name`` (module docstring), read on demand.

    Args:
      name: one of :data:`IMAGE_BENCHMARKS`.
      image_size, mean, std: the checkpoint's preprocessing
        (:func:`lowrank_jax.models.hf_vit.preprocessing`).
      shuffle, seed: the class order (:func:`class_order`).
      split_seed: the seed of ImageNet-R's 80/20 split (:func:`lowrank_jax.data.tfds_images.imagenet_r_is_test`),
        the same for every run by default.
      num_tasks, classes_per_task: a shorter stream than the benchmark's (smoke runs): the first
        ``num_tasks · classes_per_task`` classes of the order; default the benchmark's tasks
        over all classes.
      data_dir, cache_dir, num_threads: as :func:`lowrank_jax.data.tfds_image_source`.

    Returns:
      A class-incremental :class:`~lowrank_jax.continual.TaskStream` whose splits' ``"x"`` are
      :class:`~lowrank_jax.data.ImageRows`.

    Raises:
      ValueError: an unknown name, task sizes that do not fit the classes, or a class of the
        stream without train or test images.
      FileNotFoundError: a dataset that is not prepared (the message gives the command).
    """
    if name not in IMAGE_BENCHMARKS:
        raise ValueError(f"name={name!r} is not one of {sorted(IMAGE_BENCHMARKS)}.")
    bench = IMAGE_BENCHMARKS[name]
    read = dict(data_dir=data_dir, seed=split_seed, cache_dir=cache_dir, num_threads=num_threads)
    train = tfds_image_source(bench.dataset, split="train", **read)
    test = tfds_image_source(bench.dataset, split="test", **read)
    C = train.num_classes
    tasks = bench.num_tasks if num_tasks is None else int(num_tasks)
    per_task = C // tasks if classes_per_task is None else int(classes_per_task)
    if tasks < 1 or per_task < 1 or tasks * per_task > C:
        raise ValueError(
            f"{tasks} tasks of {per_task} classes do not fit the {C} classes of {name}."
        )
    order = class_order(C, shuffle=shuffle, seed=seed)[: tasks * per_task]
    evaluate = eval_transform(image_size, mean=mean, std=std, crop_fraction=bench.crop_fraction)
    stream_tasks, groups = [], np.split(order, tasks)
    for classes in groups:
        splits = {}
        for split, source in (("train", train), ("test", test)):
            rows = np.flatnonzero(np.isin(source.labels, classes))
            missing = np.setdiff1d(classes, source.labels[rows])
            if missing.size:
                raise ValueError(f"{name}: classes {missing.tolist()} have no {split} images.")
            x = ImageRows(source, rows, transform=evaluate)
            splits[split] = {"x": x, "y": source.labels[rows].astype(np.int32)}
        stream_tasks.append(splits)
    return TaskStream(stream_tasks, [np.sort(g) for g in groups], C, "cil", None, 0)


def train_batches(
    stream: TaskStream,
    tasks: int | Sequence[int],
    *,
    batch_size: int,
    seed: int,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    state: dict[str, int] | None = None,
) -> ImageBatches:
    """Resumable training batches of task(s) ``tasks`` of an :func:`image_cil` stream, with
    InfLoRA's augmentation (:func:`lowrank_jax.data.train_transform` at the stream's image size,
    ``mean`` and ``std`` those given to :func:`image_cil`): what
    :func:`~lowrank_jax.continual.streams.training_arrays` gives for streams held in memory.

    Returns:
      An endless :class:`~lowrank_jax.data.ImageBatches` of ``{"x", "y", "mask": (b, C) bool}``
      (the mask as ``training_arrays``'s: the task's classes, or every class for several tasks
      at once); ``state`` resumes it.

    Raises:
      TypeError: the tasks' inputs are not :class:`~lowrank_jax.data.ImageRows`.
      ValueError: ``tasks`` is empty or names a task the stream does not have.
    """
    tasks = [tasks] if isinstance(tasks, int) else list(tasks)
    if not tasks or any(not 0 <= t < len(stream.tasks) for t in tasks):
        raise ValueError(f"tasks={tasks!r} must be indices of the {len(stream.tasks)} tasks.")
    parts = [stream.tasks[t]["train"]["x"] for t in tasks]
    for t, x in zip(tasks, parts, strict=True):
        if not isinstance(x, ImageRows):
            raise TypeError(
                f"task {t}'s inputs are {type(x).__name__}, not ImageRows: use "
                "continual.image_cil's streams, or training_arrays for arrays."
            )
    x = ImageRows.concatenate(parts)
    mask = np.ones(stream.num_classes, bool)  # several tasks at once (joint): every class
    if len(tasks) == 1:
        mask[:] = False
        mask[stream.task_classes[tasks[0]]] = True
    return ImageBatches(
        x.source,
        x.rows,
        transform=train_transform(x.shape[1], mean=mean, std=std),
        batch_size=batch_size,
        seed=seed,
        state=state,
        extra={"mask": mask},
    )
