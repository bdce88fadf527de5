r"""The image transforms of the pre-trained-ViT continual benchmarks, on the host with PIL.

:func:`train_transform` is the training augmentation of InfLoRA's repository (``utils/data.py``
of github.com/liangyanshuo/InfLoRA, after PyCIL): torchvision's ``RandomResizedCrop(size)``
(scale ``(0.08, 1)``, aspect ratio ``(3/4, 4/3)``, bilinear) and ``RandomHorizontalFlip()``;
:func:`eval_transform` is its test transform, ``Resize(round(size / crop_fraction))`` of the
shorter side and ``CenterCrop(size)`` (``crop_fraction = 224/256`` for ImageNet-R and
DomainNet, 1 for CIFAR-100's ``Resize(224)``). Both end as ``ToTensor`` does (``[0, 1]``) and
then normalise per channel, ``(x - mean) / std``, with the checkpoint's statistics
(``lowrank_jax.models.hf_vit.preprocessing``). InfLoRA itself feeds ``[0, 1]`` images
(``Normalize(0, 1)``); pass ``mean=(0, 0, 0), std=(1, 1, 1)`` for that.

A transform is a function ``(image, rng) -> (size, size, 3) float32`` of one ``uint8``
``(H, W, C)`` image of any size and a ``numpy.random.Generator`` (the evaluation transform draws
nothing from it), so an image's augmentation is fixed by the generator it is given:
:class:`lowrank_jax.data.ImageBatches` spawns one per image from a generator seeded by the
batch's position, and transforms a batch's images on several threads (PIL releases the GIL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["Transform", "eval_transform", "random_resized_crop_box", "train_transform"]

Transform = Callable[[np.ndarray, np.random.Generator | None], np.ndarray]


def random_resized_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """The crop ``(top, left, h, w)`` of torchvision's ``RandomResizedCrop.get_params``.

    Up to ten draws of an area fraction ``s ~ U(scale)`` and a log-uniform aspect ratio
    ``a ~ exp(U(log ratio))`` give ``w = round(sqrt(s H W a))``, ``h = round(sqrt(s H W / a))``;
    the first that fits is placed uniformly. Otherwise the centre crop of the whole image
    clipped to the ratio range.

    Args:
      height, width: the image's ``H``, ``W``.
      rng: the random draws.
      scale: range of the crop's area as a fraction of the image's.
      ratio: range of the crop's aspect ratio ``w / h``.

    Returns:
      ``(top, left, h, w)`` with ``0 < h <= H``, ``0 < w <= W``.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def _check(size: int, mean: Sequence[float], std: Sequence[float]) -> tuple[np.ndarray, ...]:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int; got {size!r}.")
    m, s = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    if m.shape != (3,) or s.shape != (3,) or np.any(s <= 0):
        raise ValueError(f"mean and std must be three numbers (std > 0); got {mean!r}, {std!r}.")
    return m, s


def _pil(image: np.ndarray):
    from PIL import Image

    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim not in (2, 3):
        raise ValueError(f"expected a uint8 (H, W[, C]) image; got {image.dtype} {image.shape}.")
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    return Image.fromarray(image).convert("RGB")


def _finish(image, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return (np.asarray(image, np.float32) / np.float32(255.0) - mean) / std


def train_transform(
    size: int,
    *,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Transform:
    """InfLoRA's training augmentation: random resized crop to ``size``, horizontal flip.

    Per image, a crop box from :func:`random_resized_crop_box`, resized to ``size x size``
    (PIL bilinear, as torchvision on PIL images), then flipped left-right with probability
    1/2; scaled to ``[0, 1]`` and normalised.

    Args:
      size: the output side (the checkpoint's image size, 224 for ViT-B/16).
      mean, std: per-channel normalisation.
      scale, ratio: as in :func:`random_resized_crop_box`.

    Returns:
      A :data:`Transform`.

    Raises:
      ValueError: a size that is not positive, or mean/std that are not three numbers.
    """
    m, s = _check(size, mean, std)
    from PIL import Image

    def transform(image: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        if rng is None:
            raise ValueError("train_transform draws its crop and flip from rng; pass one.")
        im = _pil(image)
        top, left, h, w = random_resized_crop_box(
            im.height, im.width, rng, scale=scale, ratio=ratio
        )
        im = im.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return _finish(im, m, s)

    return transform


def eval_transform(
    size: int,
    *,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    crop_fraction: float = 224 / 256,
) -> Transform:
    """InfLoRA's test transform: resize the shorter side, centre crop ``size x size``.

    The shorter side goes to ``int(size / crop_fraction)`` (the longer one keeps the aspect
    ratio; PIL bilinear), then the centre ``size x size`` is cut (torchvision's ``Resize(256)``,
    ``CenterCrop(224)`` for ``crop_fraction = 224/256``; ``Resize(224)`` of a square image for
    1); scaled to ``[0, 1]`` and normalised. Deterministic: ``rng`` is not used.

    Args:
      size: the output side.
      mean, std: per-channel normalisation.
      crop_fraction: the centre crop's side over the resized shorter side, in ``(0, 1]``.

    Returns:
      A :data:`Transform`.

    Raises:
      ValueError: a size that is not positive, mean/std that are not three numbers, or a
        crop fraction outside ``(0, 1]``.
    """
    m, s = _check(size, mean, std)
    if not 0 < crop_fraction <= 1:
        raise ValueError(f"crop_fraction must lie in (0, 1]; got {crop_fraction!r}.")
    short = int(size / crop_fraction)
    from PIL import Image

    def transform(image: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        del rng
        im = _pil(image)
        if im.width <= im.height:
            w, h = short, int(short * im.height / im.width)
        else:
            h, w = short, int(short * im.width / im.height)
        im = im.resize((w, h), Image.BILINEAR)
        top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
        return _finish(im.crop((left, top, left + size, top + size)), m, s)

    return transform
