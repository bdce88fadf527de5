"""Prepared TensorFlow Datasets (cifar100, imagenet_r, ...) read through ``tfds.data_source``."""

from __future__ import annotations

import os

import numpy as np

from lowrank_jax.data.records import Dataset

__all__ = ["load_tfds", "open_data_source", "resize_images"]

_TFDS_INSTALL = "pip install 'tensorflow-datasets>=4.9.10,<5' array_record"


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError(
            f"load_tfds needs tensorflow_datasets (TensorFlow itself is not needed). Install it "
            f"with:\n    {_TFDS_INSTALL}"
        ) from err
    return tfds


def open_data_source(name: str, *, split: str, data_dir: str | os.PathLike | None = None):
    """``tfds.data_source(name, split=split, data_dir=data_dir, download=False)``, with one
    error that says how to prepare the dataset when it is not prepared.

    Args:
      name: TFDS name (a config and version may follow: ``"domainnet/real:1.0.0"``).
      split: TFDS split spec.
      data_dir: TFDS data directory; default TFDS's own.

    Returns:
      The random-access data source (``len``, ``source[i]`` a dict of NumPy features,
      ``source.dataset_info``).

    Raises:
      ImportError: ``tensorflow_datasets`` is not installed (the message gives the command).
      FileNotFoundError: the dataset is not prepared in ``array_record`` format in ``data_dir``
        (the message gives the ``tfds build`` command).
    """
    tfds = _import_tfds()
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except (NotImplementedError, FileNotFoundError, AssertionError, KeyError) as err:
        # An unprepared dataset surfaces as FileNotFoundError/AssertionError, or (at the default
        # data_dir, where tfds finds the registered builder's metadata) as a KeyError about an
        # empty split dict; all mean the same thing to the user.
        if isinstance(err, KeyError) and "empty" not in str(err):
            raise
        where = data_dir or tfds.core.constants.get_default_data_dir()
        default = "" if data_dir else " (the default TFDS data_dir)"
        pass_dir = "" if data_dir else " (or pass data_dir=DIR for another directory)"
        raise FileNotFoundError(
            f"TFDS dataset {name!r} (split {split!r}) is not prepared for random access in "
            f"{where}{default}. Prepare it in array_record format where it can be downloaded:\n"
            f"    tfds build {name} --file_format=array_record --data_dir={where}\n"
            f"then copy {where} here{pass_dir}."
        ) from err


def _resize_weights(n_in: int, n_out: int) -> np.ndarray:
    """``(n_out, n_in)`` weights of antialiased linear (triangle-kernel) resampling.

    Output pixel ``i`` sits at input coordinate ``c_i = (i + 1/2) n_in / n_out - 1/2``; with the
    kernel width ``s = max(n_in / n_out, 1)`` its weights are ``max(0, 1 - |j - c_i| / s)`` over
    input pixels ``j``, normalised to sum to one (half-pixel centres, as ``jax.image.resize``
    with ``method="linear"``, ``antialias=True``).
    """
    scale = n_in / n_out
    centres = (np.arange(n_out) + 0.5) * scale - 0.5
    width = max(scale, 1.0)
    w = np.maximum(0.0, 1.0 - np.abs(np.arange(n_in)[None, :] - centres[:, None]) / width)
    return w / w.sum(axis=1, keepdims=True)


def resize_images(images, size: tuple[int, int]) -> np.ndarray:
    """Resizes one ``(H, W, C)`` image or a batch ``(B, H, W, C)`` to ``size`` with NumPy.

    Separable antialiased linear resampling, ``out = R_h @ image @ R_w^T`` per channel with the
    ``(h, H)`` and ``(w, W)`` weight matrices of ``jax.image.resize(method="linear")``; runs on
    the host without compiling a kernel per input shape.

    Args:
      images: ``(H, W, C)`` or ``(B, H, W, C)`` float array.
      size: the output ``(h, w)``.

    Returns:
      ``float32`` array of shape ``(h, w, C)`` or ``(B, h, w, C)``.
    """
    images = np.asarray(images, np.float32)
    if images.ndim not in (3, 4):
        raise ValueError(f"resize_images expects (H, W, C) or (B, H, W, C); got {images.shape}.")
    h, w = (int(s) for s in size)
    if h < 1 or w < 1:
        raise ValueError(f"size must be two positive ints (h, w); got {size!r}.")
    rh = _resize_weights(images.shape[-3], h).astype(np.float32)
    rw = _resize_weights(images.shape[-2], w).astype(np.float32)
    return np.einsum("oh,...hwc,pw->...opc", rh, images, rw, optimize=True)


def _stack_features(values: list, *, name: str, image_size) -> np.ndarray:
    first = np.asarray(values[0])
    if first.dtype.kind in "SUO":
        out = np.empty(len(values), dtype=object)
        out[:] = [v.decode() if isinstance(v, bytes) else v for v in values]
        return out
    arrays = [np.asarray(v) for v in values]
    if first.dtype == np.uint8:  # Images: bytes -> [0, 1].
        arrays = [a.astype(np.float32) / np.float32(255.0) for a in arrays]
    if image_size is not None:
        if first.ndim != 3:
            raise ValueError(f"image_size needs (H, W, C) images in {name!r}; got {first.shape}.")
        return np.stack([resize_images(a, image_size) for a in arrays])
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(
            f"Feature {name!r} has examples of different shapes (e.g. {sorted(shapes)[:3]}); pass "
            "image_size=(h, w) to resize them to one shape."
        )
    return np.stack(arrays)


def load_tfds(
    name: str,
    *,
    split: str,
    data_dir: str | os.PathLike | None = None,
    image_key: str = "image",
    label_key: str = "label",
    max_examples: int | None = None,
    image_size: tuple[int, int] | None = None,
) -> Dataset:
    """Loads a prepared TFDS dataset into memory as a ``Dataset`` (TensorFlow not needed).

    Reads ``tfds.data_source(name, split=split, data_dir=data_dir, download=False)``, the random
    access (ArrayRecord) interface of TFDS, so the dataset must already be prepared in
    ``array_record`` format under ``data_dir`` (e.g. on a machine with network access:
    ``tfds build cifar100 --file_format=array_record --data_dir=...``). Nothing is downloaded.
    ``tensorflow_datasets`` is imported only when this function runs.

    Args:
      name: TFDS name, e.g. ``"cifar100"`` or ``"imagenet_r"`` (a version may follow ``:``).
      split: TFDS split spec, e.g. ``"train"`` or ``"test[:10%]"``.
      data_dir: TFDS data directory; default TFDS's own (``~/tensorflow_datasets``).
      image_key: feature holding the examples ``x``. ``uint8`` images become ``float32`` in
        ``[0, 1]``; strings become an ``object`` array.
      label_key: feature holding the integer class label ``y``; class names come from its
        ``ClassLabel`` feature when there is one.
      max_examples: read only the first ``max_examples`` examples of the split.
      image_size: resize every image to ``(h, w)`` (antialiased linear, see ``resize_images``);
        needed for datasets whose images differ in size, such as ImageNet-R.

    Returns:
      ``Dataset`` with ``x`` of shape ``(N, ...)`` and ``y`` ``int32`` ``(N,)``.

    Raises:
      ImportError: if ``tensorflow_datasets`` is not installed (the message gives the command).
      FileNotFoundError: if the dataset is not prepared in ``array_record`` format in ``data_dir``
        (the message gives the ``tfds build`` command).
      ValueError: if ``split`` is not a split of a prepared dataset (tfds's message lists them).
      KeyError: if ``image_key`` or ``label_key`` is not a feature of the dataset.
      ValueError: if examples differ in shape and ``image_size`` is not given.

    Example:
      >>> with tfds.testing.mock_data(num_examples=8):
      ...     ds = load_tfds("cifar100", split="train")
      >>> ds.x.shape, ds.num_classes
      ((8, 32, 32, 3), 100)
    """
    if max_examples is not None and (not isinstance(max_examples, int) or max_examples < 1):
        raise ValueError(f"max_examples must be a positive integer or None; got {max_examples!r}.")
    source = open_data_source(name, split=split, data_dir=data_dir)

    n = len(source) if max_examples is None else min(len(source), max_examples)
    if n == 0:
        raise ValueError(f"TFDS split {split!r} of {name!r} is empty.")
    examples = [source[i] for i in range(n)]
    for key in (image_key, label_key):
        if key not in examples[0]:
            raise KeyError(
                f"{key!r} is not a feature of {name!r}; its features are {sorted(examples[0])}. "
                "Pass image_key=/label_key=."
            )
    x = _stack_features([e[image_key] for e in examples], name=image_key, image_size=image_size)
    y = np.asarray([e[label_key] for e in examples]).astype(np.int32)

    feature = source.dataset_info.features[label_key]
    names = getattr(feature, "names", None)
    if not names:
        names = [str(i) for i in range(int(y.max()) + 1)]
    return Dataset(x, y, tuple(names))
