"""The TFDS path through tfds.data_source, tested with tfds.testing.mock_data."""

import sys

import jax
import numpy as np
import pytest

from lowrank_jax.data import BatchIterator, load_tfds, resize_images

tfds = pytest.importorskip("tensorflow_datasets")


def test_mock_cifar100():
    with tfds.testing.mock_data(num_examples=9):
        ds = load_tfds("cifar100", split="train")
        again = load_tfds("cifar100", split="train")
        few = load_tfds("cifar100", split="train", max_examples=4)
        coarse = load_tfds("cifar100", split="test", label_key="coarse_label")
    assert ds.x.shape == (9, 32, 32, 3) and ds.x.dtype == np.float32
    assert ds.x.min() >= 0.0 and ds.x.max() <= 1.0
    assert ds.y.shape == (9,) and ds.y.dtype == np.int32
    assert ds.num_classes == 100 and ds.y.max() < 100
    np.testing.assert_array_equal(ds.x, again.x)  # mock examples are deterministic
    np.testing.assert_array_equal(few.x, ds.x[:4])
    assert coarse.num_classes == 20
    batch = next(BatchIterator(ds, batch_size=4, seed=0))
    assert batch["x"].shape == (4, 32, 32, 3)


def test_mock_images_of_different_sizes_need_image_size():
    with tfds.testing.mock_data(num_examples=5):
        with pytest.raises(ValueError, match="image_size"):
            load_tfds("imagenet_r", split="test")
        ds = load_tfds("imagenet_r", split="test", image_size=(16, 24))
    assert ds.x.shape == (5, 16, 24, 3) and ds.x.dtype == np.float32
    assert ds.num_classes == 1000  # TFDS labels ImageNet-R with the 1000 ImageNet classes


def test_mock_errors():
    with tfds.testing.mock_data(num_examples=2), pytest.raises(KeyError, match="features"):
        load_tfds("mnist", split="train", image_key="img")


def test_unprepared_dataset_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="array_record"):
        load_tfds("mnist", split="train", data_dir=str(tmp_path))


def test_missing_tfds_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install 'tensorflow-datasets"):
        load_tfds("mnist", split="train")


@pytest.mark.parametrize(
    "shape, size", [((13, 9, 2), (5, 4)), ((6, 7, 3), (15, 11)), ((8, 8, 1), (8, 8))]
)
def test_resize_matches_jax_image_resize(shape, size):
    image = np.random.default_rng(0).uniform(size=shape).astype(np.float32)
    expected = jax.image.resize(image, (*size, shape[-1]), method="linear", antialias=True)
    np.testing.assert_allclose(resize_images(image, size), np.asarray(expected), atol=1e-5)
    batch = np.stack([image, 1 - image])
    out = resize_images(batch, size)
    assert out.shape == (2, *size, shape[-1])
    np.testing.assert_allclose(out[1], 1 - out[0], atol=1e-5)  # linear and weights sum to one
