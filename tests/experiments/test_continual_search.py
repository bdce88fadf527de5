"""The continual experiment's validation split and hyper-parameter search, and mnist_cil."""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import pytest

from configs import saber as saber_config
from experiments import common, continual
from experiments.common import continual_report, continual_search, plots
from lowrank_jax import data


def _tiny(arg: str):
    config = saber_config.get_config(arg)
    config.data.num_tasks = 2
    config.schedule.steps_per_task = 8
    config.log.progress = False
    config.head = "masked"  # the protocol's head (digits_cil defaults to aligned): fast tests
    return config


def test_valid_indices_partition_each_class_in_the_stated_share():
    y = np.repeat(np.arange(4), [20, 7, 1, 40])
    fit, valid = continual_search.valid_indices(y, 0.15, np.random.default_rng(0))
    assert np.intersect1d(fit, valid).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([fit, valid])), np.arange(len(y)))
    # round(0.15 n_c), at least 1, at most n_c - 1 (a single-row class stays in fit)
    np.testing.assert_array_equal(np.bincount(y[valid], minlength=4), [3, 1, 0, 6])
    again = continual_search.valid_indices(y, 0.15, np.random.default_rng(0))
    np.testing.assert_array_equal(again[1], valid)


def test_validation_stream_is_disjoint_from_fit_rows_and_from_test():
    config = _tiny("smoke,benchmark=digits_cil")
    stream = continual.load_stream(config, 0)
    # mark every test row: no marked value may reach the search stream
    poisoned = dataclasses.replace(
        stream,
        tasks=[
            {**t, "test": {"x": np.full_like(t["test"]["x"], -7.0), "y": t["test"]["y"]}}
            for t in stream.tasks
        ],
    )
    search = continual_search.validation_stream(poisoned, fraction=0.15, seed=0)
    for t, (orig, part) in enumerate(zip(stream.tasks, search.tasks, strict=True)):
        for split in ("train", "test"):
            assert not np.any(part[split]["x"] == -7.0), (t, split)
        train = orig["train"]
        fit, valid = continual_search.valid_indices(
            train["y"], 0.15, np.random.default_rng([0, t, 23])
        )
        assert np.intersect1d(fit, valid).size == 0 and len(fit) + len(valid) == len(train["y"])
        np.testing.assert_array_equal(part["train"]["x"], train["x"][fit])
        np.testing.assert_array_equal(part["test"]["x"], train["x"][valid])
        np.testing.assert_array_equal(part["test"]["y"], train["y"][valid])
        # every class of the task is validated, in about the configured share
        assert set(np.unique(part["test"]["y"])) == set(stream.task_classes[t])
        assert abs(len(valid) / len(train["y"]) - 0.15) < 0.01


def test_search_choice_does_not_change_when_the_test_split_is_poisoned(tmp_path):
    """Test labels shuffled and test images replaced by noise: the same trials, scores, choice."""
    config = _tiny("smoke,benchmark=digits_cil,search=2")
    stream = continual.load_stream(config, 0)
    options = common.TrainOptions.from_config(config)
    workdir = str(tmp_path / "seed_0")
    model, variables = continual.build_backbone(config, stream, 0, workdir, options=options)
    rng = np.random.default_rng(5)
    poisoned = dataclasses.replace(
        stream,
        tasks=[
            {
                **t,
                "test": {
                    "x": rng.normal(size=t["test"]["x"].shape).astype(np.float32),
                    "y": rng.permutation(t["test"]["y"]),
                },
            }
            for t in stream.tasks
        ],
    )
    choices = []
    for name, s in (("clean", stream), ("poisoned", poisoned)):
        run = functools.partial(
            continual.run_method,
            name="o_lora",
            seed=0,
            model=model,
            variables=variables,
            options=options,
        )
        wd = str(tmp_path / name)
        choices.append(continual_search.search(config, "o_lora", s, run, wd, options=options))
    clean, dirty = choices
    assert len(clean["trials"]) == 2
    assert clean["trials"][0]["values"] != clean["trials"][1]["values"]
    assert clean["values"] == dirty["values"] and clean["trial"] == dirty["trial"]
    assert [t["valid_final_acc"] for t in clean["trials"]] == [
        t["valid_final_acc"] for t in dirty["trials"]
    ]
    best = max(t["valid_final_acc"] for t in clean["trials"])
    assert clean["valid_final_acc"] == best


def test_trials_share_the_learning_rate_across_methods_and_apply_values_copies():
    config = saber_config.get_config("benchmark=split_digits,search=4")
    trials = {m: continual_search.sample_trials(config, m) for m in continual.METHODS}
    lr0 = config.optim.learning_rate
    for m, ts in trials.items():
        assert len(ts) == 4, m
        lrs = [t["optim.learning_rate"] for t in ts]
        assert lrs == [t["optim.learning_rate"] for t in trials["seq_lora"]], m
        assert all(lr0 / 5 <= lr <= 5 * lr0 for lr in lrs)
        keys = {"optim.learning_rate"} | {p for p, *_ in continual_search.SPACES[m]}
        assert all(set(t) == keys for t in ts), m
    tuned = continual_search.apply_values(config, trials["saber"][0])
    assert tuned.method.saber.energy_strength == trials["saber"][0]["method.saber.energy_strength"]
    assert config.method.saber.energy_strength == 4.0  # the original is unchanged
    with pytest.raises(ValueError, match="unknown config key"):
        continual_search.apply_values(config, {"method.saber.kappa": 1.0})
    config.data.valid_fraction = 0.9
    with pytest.raises(common.ConfigError, match="valid_fraction"):
        continual.check_config(config)


def test_compare_heads_crosses_every_trial_with_every_head():
    config = saber_config.get_config("benchmark=digits_cil,compare_heads")
    # digits_cil's default head is the one chosen on validation; the task-incremental stays masked
    assert config.head == "aligned" and config.search.trials == 0
    for name in ("shakespeare_plays", "split_mnist", "mnist_cil", "long_stream"):
        assert saber_config.get_config(f"benchmark={name}").head == "aligned"
    assert saber_config.get_config("benchmark=split_digits,head=prototype").head == "prototype"
    assert saber_config.get_config("benchmark=split_digits").head == "masked"
    assert config.search.heads == ("masked", "aligned")
    config.search.heads = ("masked", "aligned", "prototype")
    alone = continual_search.candidates(config, "saber")  # the configured values, one per head
    assert [v for _, _, v in alone] == [{"head": h} for h in ("masked", "aligned", "prototype")]
    assert len({k for k, _, _ in alone}) == len({d for _, d, _ in alone}) == 3
    config.search.trials = 2
    crossed = continual_search.candidates(config, "o_lora")
    trials = continual_search.sample_trials(config, "o_lora")
    assert [v for _, _, v in crossed] == [
        {**t, "head": h} for t in trials for h in ("masked", "aligned", "prototype")
    ]
    assert continual_search.apply_values(config, crossed[1][2]).head == "aligned"
    chosen = {
        "saber": {
            "trials": [
                {"values": v, "valid_final_acc": a}
                for (_, _, v), a in zip(alone, (0.5, 0.75, 0.625), strict=True)
            ]
        }
    }
    table = continual_report.heads_markdown(chosen)
    assert "| saber | 0.500 | 0.750 | 0.625 |" in table and "valid aligned" in table
    # several trials per head: one column per head, the best trial of each
    chosen["o_lora"] = {
        "trials": [
            {"values": v, "valid_final_acc": 0.1 * (i + 1)} for i, (_, _, v) in enumerate(crossed)
        ]
    }
    table = continual_report.heads_markdown(chosen)
    assert table.splitlines()[0].count("valid masked") == 1
    assert "| o_lora | 0.400 | 0.500 | 0.600 |" in table
    config.search.heads = ("masked", "lda")
    with pytest.raises(common.ConfigError, match="search.heads"):
        continual.check_config(config)


def test_mnist_cil_stream_has_no_digit_in_its_base_session():
    config = saber_config.get_config("smoke,benchmark=mnist_cil")
    config.data.num_tasks = 5
    continual.check_config(config)
    try:
        stream = continual.load_stream(config, 0)
    except FileNotFoundError as e:  # the Debian package dataset-fashion-mnist
        pytest.skip(str(e))
    assert len(stream.tasks) == 5 and not stream.keep_base_head
    np.testing.assert_array_equal(np.sort(np.concatenate(stream.task_classes)), np.arange(10))
    assert all(len(c) == 2 for c in stream.task_classes)
    fashion = data.load_fashion_mnist("train")
    np.testing.assert_array_equal(stream.base["x"][:5], fashion.x[:5])
    assert stream.base_classes == 10 and len(stream.base["y"]) == 60000
    for t, task in enumerate(stream.tasks):
        assert set(np.unique(task["train"]["y"])) == set(stream.task_classes[t])
        assert len(task["train"]["y"]) == 2 * config.data.train_per_class


def test_heatmap_png_and_bad_shape(tmp_path):
    path = plots.plot_heatmap(
        tmp_path / "m.png", np.tril(np.full((3, 3), 0.5)), title="R", vmin=0.0, vmax=1.0
    )
    assert os.path.getsize(path) > 1000
    with pytest.raises(ValueError, match="2-D"):
        plots.plot_heatmap(tmp_path / "v.png", np.zeros(3), title="v")
