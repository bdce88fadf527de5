"""The papers' methods in the fine-tuning job (configs/llm_sft.py, issue #46 item 2): continual
fine-tuning over data files with each method of ``lowrank_jax.continual``, GIST selection of the
training rows (P11), and a TFDS dataset as the data source (``tfds.testing.mock_data``). All on
the tiny random Llama and JSONL files of ``experiments.common.llm_fixture``: the training file's
plain-text rows are one task, its prompt/completion and chat rows the other."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from configs import llm_sft as sft_config
from experiments import common, llm_sft
from experiments.common import llm_continual, llm_fixture


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The fixture's checkpoint and files, and two tasks: ``{"text"}`` rows vs the others."""
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("fixture")
    built = llm_fixture.build(d)
    out = dict(built)
    for split in ("train", "valid"):
        with open(built[split]) as f:
            rows = [json.loads(line) for line in f]
        out[f"{split}_text"] = _write(d / f"{split}_text.jsonl", [r for r in rows if "text" in r])
        out[f"{split}_chat"] = _write(
            d / f"{split}_chat.jsonl", [r for r in rows if "text" not in r]
        )
    return out


def _config(files, steps=4):
    config = sft_config.get_config("smoke")
    config.checkpoint = files["checkpoint"]
    config.schedule.num_steps, config.schedule.warmup_steps = steps, 1
    config.eval.num_samples, config.export.merged = 0, False
    config.log.progress = False
    return config


@pytest.mark.parametrize("method", llm_continual.METHODS)
def test_continual_over_files_reports_per_task_losses_and_forgetting(files, tmp_path, method):
    config = _config(files)
    config.data.train = f"{files['train_text']},{files['train_chat']}"
    config.data.valid = f"{files['valid_text']},{files['valid_chat']}"
    config.continual.method = method
    m = llm_sft.run(config, str(tmp_path))
    assert m["task_names"] == ["train_text.jsonl", "train_chat.jsonl"]
    losses = np.asarray(m["task_losses"])
    assert losses.shape == (2, 2) and np.isfinite(losses).all()
    assert len(m["forgetting"]) == 2 and all(math.isfinite(f) for f in m["forgetting"])
    assert m["forgetting"][0] == pytest.approx(losses[1, 0] - losses[0, 0])
    assert m["forgetting"][1] == 0.0 and m["mean_forgetting"] == pytest.approx(m["forgetting"][0])
    assert m["final_losses"] == pytest.approx(losses[1].tolist())
    # each task learns: its loss right after it is below its loss on the base model
    assert all(losses[j, j] < m["valid_loss_before"][j] for j in range(2)), (losses, m)
    table = (tmp_path / "results.md").read_text()
    assert "| train_chat.jsonl |" in table and "forgetting" in table
    records = common.read_metrics(tmp_path / "task_1")
    assert records[-1]["step"] == 4


def test_continual_needs_a_method_for_several_files_and_plain_lora(files):
    config = _config(files)
    config.data.train = f"{files['train_text']},{files['train_chat']}"
    with pytest.raises(common.ConfigError, match="--config.continual.method=saber"):
        llm_sft.check_config(config)
    config.continual.method, config.adapter.method = "inflora", "dora"
    with pytest.raises(common.ConfigError, match="adapter.method=lora"):
        llm_sft.check_config(config)
    config.adapter.method, config.data.valid = "lora", files["valid_text"]
    with pytest.raises(common.ConfigError, match="one valid source per training source"):
        llm_sft.check_config(config)
    config.data.valid, config.continual.method = "", "ewc"
    with pytest.raises(common.ConfigError, match="continual.method='ewc'"):
        llm_sft.check_config(config)


def test_gist_keeps_the_fraction_of_rows_chosen_for_the_target(files, tmp_path):
    """A quarter of the 192 training rows, chosen for the chat/prompt validation rows: the kept
    rows are not a random quarter, and they lean to the target's forms (2/3 of the pool)."""
    config = _config(files)
    config.data.train, config.data.valid = files["train"], files["valid_chat"]
    config.select.fraction = 0.25
    m = llm_sft.run(config, str(tmp_path))
    kept = m["selected_rows"]
    assert len(kept) == m["train_rows"] == 48 and len(set(kept)) == 48
    assert max(kept) < 192
    with open(files["train"]) as f:
        is_target = np.array(["text" not in json.loads(line) for line in f])
    rng = np.random.default_rng(0)
    random_share = [is_target[rng.choice(192, 48, replace=False)].mean() for _ in range(200)]
    share = is_target[kept].mean()
    assert share > np.quantile(random_share, 0.99), (share, np.quantile(random_share, 0.99))
    assert "GIST (P11) kept 48 of 192 training rows" in (tmp_path / "results.md").read_text()
    assert m["valid_loss_after"] < m["valid_loss_before"]


def test_a_tfds_dataset_is_a_data_source(files, tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    config = _config(files, steps=3)
    config.data.train, config.data.valid = "tfds:imdb_reviews", "tfds:imdb_reviews@test"
    config.data.tfds_max_rows = 40  # (mock texts are short: 40 rows pack into 5)
    config.data.batch_size = config.eval.batch_size = 4
    with tfds.testing.mock_data(num_examples=60, policy=tfds.testing.MockPolicy.USE_CODE):
        m = llm_sft.run(config, str(tmp_path))
    assert m["train_rows"] == 40 and m["valid_rows"] == 40
    assert math.isfinite(m["valid_loss_after"])
    config.data.tfds_text = ""
    with pytest.raises(common.ConfigError, match="data.tfds_text"):
        llm_sft.check_config(config)


def test_fp8_logits_log_zero_overflows_at_the_geometry_scale_and_some_at_too_large_ones(
    files, tmp_path
):
    """P14 in the fine-tuning job: every evaluation logs the overflow counts of the geometry-aware
    scale (0) and of the naive amax scale calibrated on the first training batch (> 0 on the
    validation rows); `fp8.calibration=1e4` (a scale 10⁴ too large: a range too small) overflows."""
    config = _config(files)
    config.fp8.enabled, config.eval.every = True, 2
    m = llm_sft.run(config, str(tmp_path / "geometry"))
    evals = [r for r in common.read_metrics(tmp_path / "geometry") if "valid/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["valid/fp8_overflow"] == 0 == r["valid/fp8_overflow_layer0"]
        assert r["valid/naive_fp8_overflow"] > 0, r
        assert r["valid/naive_fp8_overflow"] == sum(
            r[f"valid/naive_fp8_overflow_layer{i}"] for i in range(2)
        )
    train = [r for r in common.read_metrics(tmp_path / "geometry") if "train/loss" in r]
    assert train and all(r["train/fp8_overflow"] == 0 for r in train)
    assert m["fp8_overflow_before"] == m["fp8_overflow_after"] == 0
    assert m["naive_fp8_overflow_before"] > 0 and m["naive_fp8_overflow_after"] > 0
    table = (tmp_path / "geometry" / "results.md").read_text()
    assert "## FP8 attention logits (P14)" in table and "| amax (naive) | after |" in table
    config.fp8.calibration, config.schedule.num_steps, config.eval.every = 1e4, 2, 0
    m = llm_sft.run(config, str(tmp_path / "too_large"))
    assert m["fp8_overflow_before"] > 0 and m["fp8_overflow_after"] > 0
    config.fp8.bound = "amax"
    with pytest.raises(common.ConfigError, match="fp8.bound"):
        llm_sft.check_config(config)
