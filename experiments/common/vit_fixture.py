"""The pre-trained-ViT benchmarks in miniature: a random tiny ViT saved by ``transformers`` and
mocked TFDS images of the first classes of CIFAR-100, ImageNet-R and DomainNet.

What the smoke runs of the image benchmarks (``configs/saber.py:benchmark=imagenet_r_10,smoke``
and the others) read in the tests, where neither the ViT-B/16 checkpoint nor the datasets can be
downloaded::

    checkpoint = write_checkpoint(directory)            # a ViTModel, 32x32 images
    with mock_images(classes=4, per_class=4):           # tfds.data_source gives these
        continual.run(config, workdir)

Needs ``transformers`` and ``torch`` (the ``peers`` extra) and ``tensorflow_datasets``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from lowrank_jax.data.imagenet_r_classes import IMAGENET_R_CLASSES
from lowrank_jax.data.tfds_images import imagenet_r_is_test

__all__ = ["TINY_VIT", "mock_images", "write_checkpoint"]

# A tiny ViT: 32x32 images in 16 patches of 8x8, two layers of width 32.
TINY_VIT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    image_size=32,
    patch_size=8,
)


def write_checkpoint(directory: str | os.PathLike, *, seed: int = 0) -> str:
    """A random tiny ``ViTModel`` (:data:`TINY_VIT`) saved by ``save_pretrained`` in
    ``directory`` (written once: a second call reads what is there). Returns the directory."""
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.ViTModel(transformers.ViTConfig(**TINY_VIT), add_pooling_layer=False)
    model.save_pretrained(directory)
    return directory


class _Source:
    """A list of examples with the builder's ``dataset_info``, as ``tfds.data_source`` gives."""

    def __init__(self, info: Any, examples: list[dict[str, Any]]):
        self.dataset_info, self._examples = info, examples

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._examples[i]


def _examples(name: str, split: str, classes: int, per_class: int) -> list[dict[str, Any]]:
    """``per_class`` images of each of the first ``classes`` classes (labels in the dataset's
    own space). ImageNet-R has one split, cut 80/20 by file name: its names are drawn until each
    class has ``per_class`` images on each side of the cut."""
    rng = np.random.default_rng([len(name), len(split)])
    out = []
    for c in range(classes):
        if name == "imagenet_r":
            label, names, i = IMAGENET_R_CLASSES[c][0], {True: [], False: []}, 0
            while min(len(v) for v in names.values()) < per_class:
                file_name = f"{IMAGENET_R_CLASSES[c][1]}/mock_{i}.jpg"
                names[bool(imagenet_r_is_test([file_name])[0])].append(file_name)
                i += 1
            files = names[True][:per_class] + names[False][:per_class]
        else:
            label, files = c, [f"{split}_{c}_{i}.jpg" for i in range(per_class)]
        for file_name in files:
            image = rng.integers(0, 256, (36, 40, 3), dtype=np.uint8)
            out.append({"image": image, "label": label, "file_name": file_name})
    return out


@contextlib.contextmanager
def mock_images(*, classes: int = 4, per_class: int = 4) -> Iterator[None]:
    """Within the block, ``tfds.data_source`` of ``cifar100``, ``imagenet_r`` and
    ``domainnet/*`` gives ``per_class`` random ``36x40`` images of each of the first ``classes``
    classes per split (``tfds.testing.mock_data`` with these examples)."""
    import tensorflow_datasets as tfds

    def as_data_source(builder: Any, split: Any = "train", **kwargs: Any) -> _Source:
        del kwargs
        return _Source(builder.info, _examples(builder.name, str(split), classes, per_class))

    with tfds.testing.mock_data(as_data_source_fn=as_data_source):
        yield
