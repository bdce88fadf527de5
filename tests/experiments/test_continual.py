"""The continual-learning experiment: config checks, method invariants and a smoke run end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import gr_lora as gr_config
from configs import saber as saber_config
from experiments import common, continual
from experiments.common import continual_backbones
from lowrank_jax import continual as lj_continual
from lowrank_jax import data


def _tiny(arg: str):
    config = saber_config.get_config(arg)
    config.data.num_tasks = 2
    config.schedule.steps_per_task = 8
    config.model.pretrain_steps = 10
    config.log.progress = False
    config.head = "masked"  # the protocol's head (digits_cil defaults to aligned): fast tests
    return config


def test_config_args_fail_early_with_allowed_values():
    with pytest.raises(common.ConfigError, match="allowed values are .*split_digits"):
        saber_config.get_config("benchmark=cifar")
    with pytest.raises(common.ConfigError, match="allowed values are all, every, saber"):
        saber_config.get_config("method=ewc")
    config = saber_config.get_config("smoke")
    config.methods = ("saber", "nope")
    with pytest.raises(common.ConfigError, match="nope"):
        continual.check_config(config)
    assert saber_config.get_config("method=o_lora").methods == ("o_lora",)
    assert len(saber_config.get_config("method=every").methods) == 8
    assert gr_config.get_config("seeds=3").seeds == (0, 1, 2)
    bench = ("long_stream", "digits_cil", "split_digits", "shakespeare_plays", "split_mnist")
    for arg in ["smoke"] + [f"smoke,benchmark={b}" for b in bench]:
        continual.check_config(saber_config.get_config(arg))
        continual.check_config(gr_config.get_config(arg))


def test_projection_methods_do_not_change_old_task_outputs():
    """InfLoRA/GPM-LoRA keep A ⟂ memory, so a memory-spanned old input sees no change."""
    config = _tiny("smoke,benchmark=digits_cil")
    config.method.memory_threshold = 1.0  # memory = everything task 0's layer inputs span
    config.method.memory_examples = 64
    stream = continual.load_stream(config, 0)
    options = common.TrainOptions.from_config(config)
    model, variables = continual.build_backbone(config, stream, 0, "/tmp/unused", options=options)
    method = continual.make_method(config, "gpm_lora", model.apply, "cil")
    x_old = stream.tasks[0]["train"]["x"][:64]
    task0 = lj_continual.Task(
        0, stream.task_classes[0], x_old, stream.tasks[0]["train"]["y"][:64], 10
    )
    state = method.init(variables)
    trainable, frozen, _ = method.begin_task(state, jax.random.key(0), task0)
    state = method.end_task(state, trainable, frozen, task0)
    tr = stream.tasks[1]["train"]
    task1 = lj_continual.Task(1, stream.task_classes[1], tr["x"][:64], tr["y"][:64], 10)
    trainable, frozen, tx = method.begin_task(state, jax.random.key(1), task1)
    a = trainable["shared"]["params/dense_0/kernel"].factors["a"]
    np.testing.assert_allclose(jnp.asarray(x_old) @ a, 0.0, atol=1e-4)
    # Train task 1 for a few steps: the layer's update ΔW = A B becomes non-zero, yet the old
    # task's inputs (which span the memory) see no change, x_old ΔW = 0. A method that trained
    # A as well, or projected only at initialisation, would fail here.
    mask = np.isin(np.arange(10), stream.task_classes[1])[None].repeat(64, 0)

    def loss(p):
        logits = method.apply(p, frozen, jnp.asarray(tr["x"][:64]))
        return lj_continual.masked_cross_entropy(logits, jnp.asarray(tr["y"][:64]), mask)

    @jax.jit
    def step(p, opt):
        updates, opt = tx.update(jax.grad(loss)(p), opt, p)
        return optax.apply_updates(p, updates), opt

    opt = tx.init(trainable)
    for _ in range(5):
        trainable, opt = step(trainable, opt)
    ad = trainable["shared"]["params/dense_0/kernel"]
    dw = _delta(ad)
    x_new = np.asarray(tr["x"][:64], np.float64)
    assert np.linalg.norm(x_new @ dw) > 1e-2 * np.linalg.norm(x_new) * np.linalg.norm(dw)
    np.testing.assert_allclose(np.asarray(x_old, np.float64) @ dw, 0.0, atol=1e-4)


def _delta(adapter):
    """``A B`` of a LoRA adapter (``ΔW`` up to its scale ``α/r``), in float64."""
    f = adapter.factors
    return np.asarray(f["a"], np.float64) @ np.asarray(f["b"], np.float64)


def test_a_users_own_loop_reproduces_the_experiment(tmp_path):
    """SABER and GR-LoRA used from a plain loop (same batches and keys as ``fit``) give the
    experiment's accuracy matrix exactly."""
    config = _tiny("smoke,benchmark=digits_cil")
    config.data.num_tasks = 2
    stream = continual.load_stream(config, 0)
    options = common.TrainOptions.from_config(config)
    workdir = str(tmp_path / "seed_0")
    model, variables = continual.build_backbone(config, stream, 0, workdir, options=options)
    for name in ("saber", "gr_lora"):
        out = continual.run_method(
            config, name, 0, stream, model, variables, str(tmp_path / name), options=options
        )
        method = continual.make_method(config, name, model.apply, "cil")
        state = method.init(variables)
        r = np.full((2, 2), np.nan)
        for t in range(2):
            tr = stream.tasks[t]["train"]
            mask = np.repeat(np.isin(np.arange(10), stream.task_classes[t])[None], len(tr["y"]), 0)
            task = lj_continual.Task(t, stream.task_classes[t], tr["x"], tr["y"], 10)
            trainable, frozen, tx = method.begin_task(
                state, jax.random.fold_in(jax.random.key(0), t), task
            )
            opt_state = tx.init(trainable)
            batches = data.BatchIterator(
                {**tr, "mask": mask}, batch_size=config.data.batch_size, seed=t
            )
            key = jax.random.fold_in(jax.random.key(0), 7919 + t)

            @jax.jit
            def step(trainable, opt_state, batch, key, frozen=frozen, tx=tx, method=method):
                def loss_fn(p):
                    logits = method.apply(p, frozen, batch["x"])
                    ce = lj_continual.masked_cross_entropy(logits, batch["y"], batch["mask"])
                    return ce + method.loss(p, frozen, batch, key)

                grads = jax.grad(loss_fn)(trainable)
                updates, opt_state = tx.update(grads, opt_state, trainable)
                return optax.apply_updates(trainable, updates), opt_state

            for i in range(config.schedule.steps_per_task):
                trainable, opt_state = step(
                    trainable, opt_state, next(batches), jax.random.fold_in(key, i)
                )
            state = method.end_task(state, trainable, frozen, task)
            r[t, : t + 1] = lj_continual.evaluate_stream(
                method, state, stream, t, batch_size=config.eval.batch_size
            )[0]
        np.testing.assert_allclose(r, out["R"], atol=1e-6, err_msg=name)


def test_smoke_run_end_to_end_and_resume(tmp_path, monkeypatch):
    config = _tiny("smoke,benchmark=split_digits")
    config.methods = ("saber", "gr_lora", "joint")
    workdir = str(tmp_path / "run")
    out = continual.run(config, workdir)
    assert not out["interrupted"]
    table = out["table"]
    assert set(table) == set(config.methods)
    _assert_table_follows_the_matrices(workdir, table, config.methods)
    for name in ("results.md", "accuracy_matrices.json", "acc_matrix_saber.png", "plasticity.png"):
        assert os.path.exists(os.path.join(workdir, name)), name
    with open(os.path.join(workdir, "accuracy_matrices.json")) as f:
        matrices = json.load(f)
    r = np.asarray(matrices["saber"][0]["R"], float)
    assert r.shape == (2, 2) and np.isnan(r[0, 1]) and np.all(np.isfinite(np.tril(r)))
    assert os.path.exists(os.path.join(workdir, "saber", "seed_0", "task_1", "checkpoints"))
    # a rerun reads the finished method x seed runs back: no training, no evaluation
    assert sorted(os.listdir(os.path.join(workdir, "cells"))) == [
        f"{m}%2Fseed=0.json" for m in sorted(config.methods)
    ]
    with monkeypatch.context() as m:
        m.setattr(continual, "run_method", lambda *a, **k: pytest.fail("a finished run was rerun"))
        again = continual.run(config, workdir)
    np.testing.assert_equal(again["table"], table)
    with open(os.path.join(workdir, "accuracy_matrices.json")) as f:
        assert json.load(f) == matrices
    # without them it replays the per-task checkpoints and reproduces the table exactly
    shutil.rmtree(os.path.join(workdir, "cells"))
    again = continual.run(config, workdir)
    np.testing.assert_equal(again["table"], table)


def test_resume_within_and_between_tasks_gives_the_same_accuracy_matrix(tmp_path, monkeypatch):
    """Stopped inside task 1 (Ctrl-C: a checkpoint at step 3) or before it starts (killed between
    tasks), a rerun ends with exactly the accuracy matrix of an uninterrupted run."""
    config = _tiny("smoke,benchmark=split_digits")
    config.methods = ("saber", "gr_lora", "inflora")
    reference = continual.run(config, str(tmp_path / "reference"))
    real_fit = common.fit

    class Killed(Exception):
        pass

    def stop_inside_task_1(*args, workdir, num_steps, **kwargs):
        if workdir.endswith("task_1") and not os.path.exists(os.path.join(workdir, "checkpoints")):
            result = real_fit(*args, workdir=workdir, num_steps=3, **kwargs)
            return dataclasses.replace(result, interrupted=True)
        return real_fit(*args, workdir=workdir, num_steps=num_steps, **kwargs)

    def kill_before_task_1(*args, workdir, **kwargs):
        if workdir.endswith("task_1"):
            raise Killed
        return real_fit(*args, workdir=workdir, **kwargs)

    for name, patched in (("within", stop_inside_task_1), ("between", kill_before_task_1)):
        workdir = str(tmp_path / name)
        with monkeypatch.context() as m:
            m.setattr(common, "fit", patched)
            try:
                out = continual.run(config, workdir)
                assert out["interrupted"]
            except Killed:
                pass
        assert not os.path.exists(os.path.join(workdir, "results.md"))
        out = continual.run(config, workdir)
        assert not out["interrupted"]
        for method in config.methods:
            assert out["table"][method] == reference["table"][method], (name, method)


def test_split_mnist_stream_is_base_plus_increments():
    config = saber_config.get_config("smoke,benchmark=split_mnist")
    config.data.num_tasks = 3
    stream = continual.load_stream(config, 1)
    assert [list(c) for c in stream.task_classes][0] == [0, 1, 2, 3, 4]
    rest = np.concatenate(stream.task_classes[1:])
    assert sorted(rest) == [5, 6, 7, 8, 9] and all(len(c) >= 2 for c in stream.task_classes)
    assert stream.keep_base_head and stream.base_classes == 5 and stream.protocol == "cil"
    assert stream.base["x"].shape[1:] == (28, 28, 1) and set(stream.base["y"]) == set(range(5))
    for task, classes in zip(stream.tasks, stream.task_classes, strict=True):
        assert set(task["train"]["y"]) == set(classes) == set(task["test"]["y"])
    config.data.num_tasks = 4
    with pytest.raises(common.ConfigError, match="increments"):
        continual.check_config(config)


def _assert_table_follows_the_matrices(workdir, table, methods):
    """The reported metrics are those of the saved accuracy matrices (float64 re-computation):
    ``final_acc`` = mean of the last row, ``forgetting`` = Chaudhry et al.'s definition,
    ``selection_acc`` = the module-selection accuracy after the last task."""
    with open(os.path.join(workdir, "accuracy_matrices.json")) as f:
        matrices = json.load(f)
    for method in methods:
        r = np.asarray(matrices[method][0]["R"], np.float64)
        t = len(r)
        np.testing.assert_allclose(table[method]["final_acc"], np.mean(r[-1]), atol=1e-12)
        if method != "joint":  # joint training has the final row only
            f = np.mean([np.max(r[j : t - 1, j]) - r[-1, j] for j in range(t - 1)])
            np.testing.assert_allclose(table[method]["forgetting"], f, atol=1e-12, err_msg=method)
        sel = (matrices[method][0].get("selection_accuracy") or [None])[-1]
        if sel is not None and not np.isnan(sel):  # methods that select a module (GR-LoRA)
            np.testing.assert_allclose(table[method]["selection_acc"], sel, atol=1e-12)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("data.plays", ("hamlet", "hamlet", "macbeth"), "distinct play keys"),
        ("data.plays", ("hamlet", "ulysses"), "distinct play keys"),
        ("data.plays_per_task", 1, "plays_per_task must be >= 2"),
        ("data.num_tasks", 6, "need 12"),
        ("data.seq_len", 600, "<= 512 tokens"),
        ("model.first_layer", 6, "first adapted MiniLM layer"),
        ("model.first_layer", True, "first adapted MiniLM layer"),
        ("model.name", "mlp", "use 'minilm'"),
    ],
)
def test_shakespeare_config_errors_name_the_key(key, value, match):
    config = saber_config.get_config("smoke")
    node, _, leaf = key.rpartition(".")
    with config.unlocked():
        common.get_path(config, node)[leaf] = value
    with pytest.raises(common.ConfigError, match=match):
        continual.check_config(config)


@pytest.mark.parametrize("name", ["split_mnist", "shakespeare_plays"])
def test_real_backbones_run_end_to_end(tmp_path, monkeypatch, name):
    """A ViT pretrained on the base session / the top of the pretrained MiniLM, two tasks."""
    config = _tiny(f"smoke,benchmark={name}")
    config.methods = ("saber", "gr_lora")  # the two with the most per-task state
    config.schedule.steps_per_task = 4
    config.method.saber.recalibrate_steps = 2
    config.method.gr_lora.ood_batch = 4
    config.method.memory_examples = 16
    config.data.train_per_class = 16
    config.data.test_per_class = 8
    config.data.batch_size = 8
    built = []  # the backbone the run starts from (building it again would cost a ViT compile)
    build = continual.build_backbone
    monkeypatch.setattr(
        continual, "build_backbone", lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    )
    out = continual.run(config, str(tmp_path))
    assert not out["interrupted"]
    _assert_table_follows_the_matrices(str(tmp_path), out["table"], config.methods)
    if name == "split_mnist":  # the base session's head rows 0-4 are kept, rows 5-9 fresh
        stream = continual.load_stream(config, 0)
        ((_, variables),) = built
        fresh = continual_backbones.make_model(config, 10).init(
            jax.random.split(jax.random.key(0))[0], stream.tasks[0]["train"]["x"][:1]
        )
        head, head0 = variables["params"]["head"], fresh["params"]["head"]
        np.testing.assert_array_equal(head["kernel"][:, 5:], head0["kernel"][:, 5:])
        assert np.abs(head["kernel"][:, :5] - head0["kernel"][:, :5]).min() > 0
        assert np.abs(head["bias"][:5]).min() > 0 and not np.any(head["bias"][5:])
