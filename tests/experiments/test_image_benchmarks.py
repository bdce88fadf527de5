"""The pre-trained-ViT class-incremental benchmarks end to end on CPU (#47): mocked TFDS images of
CIFAR-100, ImageNet-R and DomainNet on a random tiny ViT checkpoint written by ``transformers``,
every continual method on one benchmark and SABER on each, through ``configs/saber.py``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from configs import saber
from experiments import common
from experiments import continual as continual_experiment
from experiments.common import vit_fixture
from experiments.common.continual_methods import METHODS

pytest.importorskip("tensorflow_datasets")
pytest.importorskip("transformers")
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return vit_fixture.write_checkpoint(tmp_path_factory.mktemp("tiny_vit"))


def _run(benchmark: str, method: str, checkpoint: str, workdir) -> dict:
    config = saber.get_config(f"benchmark={benchmark},smoke,method={method}")
    config.model.checkpoint = checkpoint
    config.log.progress = False
    with vit_fixture.mock_images(classes=4, per_class=4):
        return continual_experiment.run(config, str(workdir))


def _check_outputs(out: dict, methods: tuple[str, ...], workdir) -> None:
    assert not out["interrupted"] and set(out["table"]) == set(methods)
    for name, row in out["table"].items():
        assert 0.0 <= row["final_acc"] <= 1.0, (name, row)
        if name != "joint":  # joint: only its final row is meaningful
            assert math.isfinite(row["forgetting"]) and 0.0 <= row["avg_inc_acc"] <= 1.0
    results = (workdir / "results.md").read_text()
    assert all(f"| {m} |" in results for m in methods)
    matrices = json.loads((workdir / "accuracy_matrices.json").read_text())
    assert all(np.shape(matrices[m][0]["R"]) == (2, 2) for m in methods)


def test_every_method_runs_the_cifar100_smoke(checkpoint, tmp_path):
    _check_outputs(_run("cifar100_10", "every", checkpoint, tmp_path), METHODS, tmp_path)


@pytest.mark.parametrize(
    "benchmark", ["imagenet_r_5", "imagenet_r_10", "imagenet_r_20", "domainnet_5"]
)
def test_saber_runs_each_benchmarks_smoke(benchmark, checkpoint, tmp_path):
    _check_outputs(_run(benchmark, "saber", checkpoint, tmp_path), ("saber",), tmp_path)


def test_configs_carry_inflora_hyper_parameters_and_refuse_a_missing_checkpoint(tmp_path):
    full = {
        b: saber.get_config(f"benchmark={b}")
        for b in ("cifar100_10", "imagenet_r_10", "domainnet_5")
    }
    for config in full.values():
        assert (config.data.batch_size, config.optim.learning_rate) == (128, 5e-4)
        assert config.model.name == "vit_b16" and config.head == "masked"
    assert [full[b].schedule.epochs_per_task for b in full] == [20, 50, 5]
    assert [full[b].adapter.rank for b in full] == [10, 10, 30]
    assert [full[b].data.num_tasks for b in full] == [10, 10, 5]
    with pytest.raises(common.ConfigError, match="config.model.checkpoint is empty"):
        continual_experiment.run(saber.get_config("benchmark=imagenet_r_10,smoke"), str(tmp_path))
    config = saber.get_config("benchmark=imagenet_r_10,smoke")
    config.model.checkpoint = str(tmp_path)
    with pytest.raises(common.ConfigError, match="is not a Hugging Face ViT checkpoint"):
        continual_experiment.check_config(config)
