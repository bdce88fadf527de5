"""CIFAR-100, ImageNet-R and DomainNet read on demand from TFDS (mocked with
`tfds.testing.mock_data`), ImageNet-R's class table and split rule, InfLoRA's transforms, and
resumable batches."""

import numpy as np
import pytest

from lowrank_jax import data
from lowrank_jax.continual.statistics import class_statistics
from lowrank_jax.data.image_transforms import random_resized_crop_box
from lowrank_jax.data.imagenet_r_classes import IMAGENET_R_CLASSES
from lowrank_jax.data.incremental import split_by_classes
from lowrank_jax.data.tfds_images import imagenet_r_is_test

tfds = pytest.importorskip("tensorflow_datasets")


def test_imagenet_r_table_is_200_imagenet_classes_at_their_indices():
    from tensorflow_datasets.datasets.imagenet2012 import imagenet_common

    with open(imagenet_common.label_names_file()) as f:
        wnids = [line.strip() for line in f if line.strip()]
    assert len(wnids) == 1000
    assert len(IMAGENET_R_CLASSES) == 200
    assert [i for i, _ in IMAGENET_R_CLASSES] == sorted({i for i, _ in IMAGENET_R_CLASSES})
    assert all(wnids[i] == w for i, w in IMAGENET_R_CLASSES)


def test_imagenet_r_split_rule_is_pinned_and_about_one_in_five():
    names = ["n01443537/art_0.jpg", "n01443537/cartoon_3.jpg", "n12267677/sketch_12.jpg"]
    names += [f"n02086240/painting_{i}.jpg" for i in range(5)]
    # the values of the rule (module docstring of lowrank_jax.data.tfds_images), pinned
    pinned = imagenet_r_is_test(names, seed=0)
    assert pinned.tolist() == [False, False, False, False, False, True, False, False]
    assert imagenet_r_is_test(names[::-1], seed=0).tolist() == pinned[::-1].tolist()
    many = [f"n01443537/art_{i}.jpg" for i in range(20000)]
    for seed in (0, 1):
        share = imagenet_r_is_test(many, seed=seed).mean()
        assert abs(share - 0.2) < 0.01
    assert (imagenet_r_is_test(many, seed=0) != imagenet_r_is_test(many, seed=1)).any()


def test_cifar100_and_domainnet_sources_read_on_demand(tmp_path):
    with tfds.testing.mock_data(num_examples=12):
        cifar = data.tfds_image_source("cifar100", split="train", num_threads=2)
        reference = tfds.data_source("cifar100", split="train")
        dn = data.tfds_image_source(
            "domainnet", split="test", domains=("real", "sketch"), cache_dir=tmp_path
        )
        cached = data.tfds_image_source(
            "domainnet", split="test", domains=("real", "sketch"), cache_dir=tmp_path
        )
        image = cifar.image(3)
        with pytest.raises(ValueError, match="domains"):
            data.tfds_image_source("domainnet", split="train", domains=("photo",))
    assert len(cifar) == 12 and cifar.num_classes == 100
    np.testing.assert_array_equal(cifar.labels, [int(reference[i]["label"]) for i in range(12)])
    np.testing.assert_array_equal(image, reference[3]["image"])
    assert image.dtype == np.uint8
    assert len(dn) == 24 and dn.num_classes == 345 and dn.part.tolist() == [0] * 12 + [1] * 12
    assert len(list(tmp_path.glob("*.npz"))) == 2
    np.testing.assert_array_equal(cached.labels, dn.labels)
    with pytest.raises(ValueError, match="one of"):
        data.tfds_image_source("imagenet", split="train")


def test_imagenet_r_maps_labels_to_200_classes_and_splits_them():
    with tfds.testing.mock_data(num_examples=400):
        raw = tfds.data_source("imagenet_r", split="test")
        train = data.tfds_image_source("imagenet_r", split="train", num_threads=1)
        test = data.tfds_image_source("imagenet_r", split="test", num_threads=1)
        original = [int(raw[i]["label"]) for i in range(400)]
        names = [str(raw[i]["file_name"]) for i in range(400)]
    in_200 = {i for i, _ in IMAGENET_R_CLASSES}
    kept = [i for i in range(400) if original[i] in in_200]  # mock labels span all 1000
    assert sorted([*train.record.tolist(), *test.record.tolist()]) == kept
    assert not set(train.record.tolist()) & set(test.record.tolist())
    is_test = imagenet_r_is_test(names)
    assert all(is_test[r] for r in test.record) and not any(is_test[r] for r in train.record)
    assert train.num_classes == 200 and train.class_names[0] == "n01443537"
    wnids = dict(IMAGENET_R_CLASSES)
    for source in (train, test):
        for row, label in zip(source.record, source.labels, strict=True):
            assert source.class_names[label] == wnids[original[row]]


def test_batches_resume_with_their_augmentation_and_tasks_split_by_class():
    with tfds.testing.mock_data(num_examples=40):
        source = data.tfds_image_source("cifar100", split="train", num_threads=1)
        tasks = split_by_classes(
            data.Dataset(source.index().x, source.labels % 4, tuple("abcd")),
            classes_per_task=2,
            seed=0,
        )
        transform = data.train_transform(16, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4))
        batches = data.ImageBatches(source, tasks[0], transform=transform, batch_size=4, seed=3)
        next(batches)
        saved = batches.state()
        expected = next(batches)
        resumed = data.ImageBatches(
            source, tasks[0], transform=transform, batch_size=4, seed=3, state=saved
        )
        again = next(resumed)
        evaluation = data.ImageBatches(
            source,
            np.arange(len(source)),
            transform=data.eval_transform(16, crop_fraction=1.0),
            batch_size=16,
            seed=0,
            shuffle=False,
            drop_remainder=False,
            num_epochs=1,
        )
        eval_batches = list(evaluation)
    assert expected["x"].shape == (4, 16, 16, 3) and expected["x"].dtype == np.float32
    np.testing.assert_array_equal(again["x"], expected["x"])
    np.testing.assert_array_equal(again["y"], expected["y"])
    task0 = set(np.unique(source.labels[tasks[0].x] % 4).tolist())
    assert set(np.unique(expected["y"] % 4).tolist()) <= task0 and len(task0) == 2
    assert [len(b["y"]) for b in eval_batches] == [16, 16, 8]
    np.testing.assert_array_equal(np.concatenate([b["y"] for b in eval_batches]), source.labels)


def test_random_resized_crop_box_follows_torchvision():
    rng = np.random.default_rng(0)
    for _ in range(200):
        top, left, h, w = random_resized_crop_box(30, 50, rng)
        assert 0 < h <= 30 and 0 < w <= 50 and top + h <= 30 and left + w <= 50
        assert 0.08 * 1500 * 0.8 <= h * w <= 1500 and 0.7 <= w / h <= 1.45
    # no draw fits: the centre crop of the whole image, clipped to the largest ratio (4/3)
    assert random_resized_crop_box(10, 40, rng, scale=(2.0, 3.0)) == (0, 13, 10, 13)


def test_transforms_normalise_flip_and_centre_crop():
    half = np.zeros((12, 12, 3), np.uint8)
    half[:, 6:] = 255  # left black, right white
    whole = data.train_transform(12, mean=(0, 0, 0), std=(1, 1, 1), scale=(1, 1), ratio=(1, 1))
    out = np.stack([whole(half, r) for r in np.random.default_rng(0).spawn(16)])
    flipped = out[:, 0, 0, 0] == 1.0
    assert 0 < flipped.sum() < 16  # both orientations occur
    for image, flip in zip(out, flipped, strict=True):
        np.testing.assert_allclose(image, (half[:, ::-1] if flip else half) / 255.0, atol=1e-7)
    grey = np.full((20, 40, 3), 51, np.uint8)  # 0.2
    x = data.eval_transform(8, mean=(0.1, 0.2, 0.3), std=(0.5, 0.5, 0.5))(grey, None)
    assert x.shape == (8, 8, 3)
    np.testing.assert_allclose(x[0, 0], [0.2, 0.0, -0.2], atol=1e-6)
    gradient = np.repeat(np.arange(40, dtype=np.uint8)[None, :, None] * 6, 20, 0).repeat(3, 2)
    centre = data.eval_transform(10, mean=(0, 0, 0), std=(1, 1, 1), crop_fraction=0.5)
    y = centre(gradient, None)[:, :, 0]  # resized to 20 x 40, centre 10 x 10
    assert abs(y.mean() - gradient.mean() / 255.0) < 0.02
    with pytest.raises(ValueError, match="crop_fraction"):
        data.eval_transform(8, crop_fraction=1.5)
    with pytest.raises(ValueError, match="mean and std"):
        data.train_transform(8, mean=(0.5,))


def test_image_rows_slice_like_the_array_of_their_transformed_images():
    """``ImageRows`` reads only the rows asked for, each the same every time, equal to the
    evaluation batches' images; the continual class statistics read it a chunk at a time."""
    with tfds.testing.mock_data(num_examples=24):
        source = data.tfds_image_source("cifar100", split="train", num_threads=2)
        transform = data.eval_transform(16, crop_fraction=1.0)
        rows = data.ImageRows(source, np.arange(3, 24), transform=transform)
        whole = np.asarray(rows)
        (batch,) = data.ImageBatches(
            source,
            np.arange(3, 24),
            transform=transform,
            batch_size=21,
            seed=0,
            shuffle=False,
            drop_remainder=False,
            num_epochs=1,
        )
        picked, one = rows[np.array([5, 0])], rows[7]
        labels = source.labels[3:]
        chunked = class_statistics(rows, labels, 100, chunk_size=4)
    assert len(rows) == 21 and rows.shape == (21, 16, 16, 3) == whole.shape
    assert whole.dtype == np.float32 and rows[2:5].shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(whole, batch["x"])
    np.testing.assert_array_equal(picked, whole[[5, 0]])
    np.testing.assert_array_equal(one, whole[7])
    np.testing.assert_allclose(chunked.mean, class_statistics(whole, labels, 100).mean, atol=1e-6)
    with pytest.raises(ValueError, match="rows must be a 1-D array"):
        data.ImageRows(source, np.array([24]), transform=transform)
