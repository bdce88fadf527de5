"""The TFDS path through tfds.data_source, tested with tfds.testing.mock_data."""

import sys

import jax
import numpy as np
import pytest

from lowrank_jax.data import BatchIterator, load_tfds
from lowrank_jax.data.tfds_source import resize_images

tfds = pytest.importorskip("tensorflow_datasets")

TINY_NAMES = ("cat", "dog", "emu")


def _tiny_examples(split):
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = 7 if split == "train" else 3
    images = rng.integers(0, 256, size=(n, 4, 5, 3), dtype=np.uint8)
    return images, np.arange(n) % 3


class LowrankJaxTinyImages(tfds.core.GeneratorBasedBuilder):
    """A real (not mocked) TFDS dataset, prepared in array_record format without TensorFlow."""

    VERSION = tfds.core.Version("1.0.0")
    code_path = None  # No checksums file to look up (finding one needs importlib_resources).

    def _info(self):
        features = {
            "image": tfds.features.Tensor(shape=(4, 5, 3), dtype=np.uint8),
            "label": tfds.features.ClassLabel(names=TINY_NAMES),
        }
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(features),
            disable_shuffling=True,  # Keep generation order, to compare with _tiny_examples.
        )

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(split) for split in ("train", "test")}

    def _generate_examples(self, split):
        images, labels = _tiny_examples(split)
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            yield i, {"image": image, "label": int(label)}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    LowrankJaxTinyImages(data_dir=data_dir, file_format="array_record").download_and_prepare()
    return data_dir


def test_prepared_array_record_dataset(tiny_dir):
    for split in ("train", "test"):
        ds = load_tfds("lowrank_jax_tiny_images", split=split, data_dir=tiny_dir)
        images, labels = _tiny_examples(split)
        assert ds.x.dtype == np.float32 and ds.y.dtype == np.int32
        np.testing.assert_allclose(ds.x, images / 255.0, atol=1e-7)
        np.testing.assert_array_equal(ds.y, labels)
        assert ds.class_names == TINY_NAMES
    few = load_tfds("lowrank_jax_tiny_images", split="train[2:5]", data_dir=tiny_dir)
    np.testing.assert_array_equal(few.y, _tiny_examples("train")[1][2:5])
    small = load_tfds("lowrank_jax_tiny_images", split="train", data_dir=tiny_dir, max_examples=2)
    assert len(small) == 2


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
    with pytest.raises(FileNotFoundError) as err:
        load_tfds("mnist", split="train", data_dir=str(tmp_path))
    assert str(err.value) == (
        f"TFDS dataset 'mnist' (split 'train') is not prepared for random access in {tmp_path}. "
        "Prepare it in array_record format where it can be downloaded:\n"
        f"    tfds build mnist --file_format=array_record --data_dir={tmp_path}\n"
        f"then copy {tmp_path} here."
    )


def test_unprepared_dataset_at_the_default_data_dir_says_how_to_prepare(tmp_path, monkeypatch):
    """At the default data_dir tfds raises an internal KeyError ("splits is empty"); not here."""
    monkeypatch.setattr(tfds.core.constants, "get_default_data_dir", lambda: str(tmp_path))
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError) as err:
        load_tfds("cifar100", split="train")
    assert str(err.value) == (
        f"TFDS dataset 'cifar100' (split 'train') is not prepared for random access in {tmp_path} "
        "(the default TFDS data_dir). Prepare it in array_record format where it can be "
        "downloaded:\n"
        f"    tfds build cifar100 --file_format=array_record --data_dir={tmp_path}\n"
        f"then copy {tmp_path} here (or pass data_dir=DIR for another directory)."
    )
    assert not isinstance(err.value.__cause__, FileNotFoundError)  # the KeyError path ran


def test_unknown_split_of_a_prepared_dataset(tiny_dir):
    with pytest.raises(
        ValueError, match=r"Unknown split 'trian'. Should be one of \['train', 'test'\]"
    ):
        load_tfds("lowrank_jax_tiny_images", split="trian", data_dir=tiny_dir)


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
