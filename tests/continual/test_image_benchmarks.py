"""The pre-trained-ViT class-incremental benchmarks from (mocked) TFDS, read on demand."""

import numpy as np
import pytest

from lowrank_jax import continual, data
from lowrank_jax.continual.image_benchmarks import IMAGE_BENCHMARKS, class_order

tfds = pytest.importorskip("tensorflow_datasets")


def test_class_order_is_pycils():
    # PyCIL's own calls, on purpose: the legacy global generator
    np.random.seed(1993)  # noqa: NPY002
    legacy = np.random.permutation(100)  # noqa: NPY002
    np.testing.assert_array_equal(class_order(100, shuffle=True, seed=1993), legacy)
    np.testing.assert_array_equal(class_order(5, shuffle=False, seed=1993), np.arange(5))


def test_benchmarks_split_classes_into_equal_tasks_read_on_demand():
    assert {n: (b.dataset, b.num_tasks) for n, b in IMAGE_BENCHMARKS.items()} == {
        "cifar100_10": ("cifar100", 10),
        "imagenet_r_5": ("imagenet_r", 5),
        "imagenet_r_10": ("imagenet_r", 10),
        "imagenet_r_20": ("imagenet_r", 20),
        "domainnet_5": ("domainnet", 5),
    }
    with tfds.testing.mock_data(num_examples=600):
        stream = continual.image_cil(
            "cifar100_10",
            image_size=16,
            shuffle=True,
            seed=3,
            num_tasks=2,
            classes_per_task=3,
            num_threads=1,
        )
        order = class_order(100, shuffle=True, seed=3)
        x0 = stream.tasks[0]["train"]["x"]
        first = x0[:4]
        batch = next(continual.train_batches(stream, 1, batch_size=4, seed=0))
        joint = next(continual.train_batches(stream, [0, 1], batch_size=4, seed=0))
        with pytest.raises(ValueError, match="do not fit the 100 classes"):
            continual.image_cil("cifar100_10", num_tasks=11, classes_per_task=10)
    assert stream.protocol == "cil" and stream.num_classes == 100 and len(stream.tasks) == 2
    for t, classes in enumerate(stream.task_classes):
        np.testing.assert_array_equal(classes, np.sort(order[3 * t : 3 * t + 3]))
        for split in ("train", "test"):
            part = stream.tasks[t][split]
            assert isinstance(part["x"], data.ImageRows) and len(part["x"]) == len(part["y"]) > 0
            assert set(np.unique(part["y"]).tolist()) == set(classes.tolist())
    assert first.shape == (4, 16, 16, 3) and first.dtype == np.float32
    assert batch["x"].shape == (4, 16, 16, 3) and set(batch["y"]) <= set(stream.task_classes[1])
    assert batch["mask"].shape == (4, 100) and np.flatnonzero(batch["mask"][2]).tolist() == sorted(
        stream.task_classes[1].tolist()
    )
    assert joint["mask"].all() and set(joint["y"]) <= set(np.concatenate(stream.task_classes))
    with pytest.raises(ValueError, match="not one of"):
        continual.image_cil("cifar10_5")
    task = {"train": {"x": np.zeros((2, 3)), "y": np.zeros(2)}}
    arrays = continual.TaskStream([task], [np.arange(1)], 1, "cil", None, 0)
    with pytest.raises(TypeError, match="not ImageRows"):
        continual.train_batches(arrays, 0, batch_size=2, seed=0)
