"""The ContinualMethod protocol: every factory in a hand-written loop; state as a pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters, continual, data, models, optim
from lowrank_jax.adapters.paths import get_path, named_leaves
from lowrank_jax.continual.capture import head_features
from lowrank_jax.continual.class_incremental import HeadState
from lowrank_jax.continual.evaluation import evaluate_tasks
from lowrank_jax.continual.gr_lora import module_adapters
from lowrank_jax.optim.orthogonal_projection import check_projection_order, is_memory

TARGETS = (r"params/dense_\d+/kernel",)
KW = dict(targets=TARGETS, rank=4, alpha=8.0, learning_rate=3e-3, grad_clip=1.0)
FACTORIES = {
    "seq_lora": lambda f: continual.sequential_lora(f, **KW),
    "joint": lambda f: continual.joint(f, **KW),
    "o_lora": lambda f: continual.o_lora(f, **KW, lambda_orth=0.5),
    "inflora": lambda f: continual.inflora(f, **KW, memory_examples=64),
    "gpm_lora": lambda f: continual.gpm_lora(f, **KW, memory_examples=64),
    "sd_lora": lambda f: continual.sd_lora(f, **KW),
    "saber": lambda f: continual.saber(
        f, **KW, recalibrate_steps=3, recalibrate_batch=16, memory_examples=64
    ),
    "gr_lora": lambda f: continual.gr_lora(f, **KW, memory_examples=64, ood_batch=8),
}


@pytest.fixture(scope="module")
def stream():
    """Two class-incremental tasks of real digits (0-4 and 5-9), a small random-feature MLP."""
    ds = data.load_digits()
    x, y = np.asarray(ds.x, np.float32).reshape(len(ds.x), -1)[:600], ds.y[:600].astype(np.int32)
    tasks = []
    for t, classes in enumerate((np.arange(5), np.arange(5, 10))):
        keep = np.isin(y, classes)
        tasks.append(continual.Task(t, classes, x[keep], y[keep], 10))
    model = models.MLP((16, 16), 10)
    return model, model.init(jax.random.key(0), x[:1]), tasks


def _loop(method, variables, tasks, steps=3):
    """The loop of the protocol's docstring, in ten lines (one fixed batch per task)."""
    state = method.init(variables)
    for task in tasks:
        trainable, frozen, tx = method.begin_task(state, jax.random.key(task.index), task)
        opt_state = tx.init(trainable)
        batch = {"x": task.x[:32], "y": task.y[:32], "mask": np.isin(np.arange(10), task.classes)}

        @jax.jit
        def step(trainable, opt_state, key, frozen=frozen, batch=batch, tx=tx):
            def loss_fn(tr):
                logits = method.apply(tr, frozen, batch["x"])
                ce = continual.masked_cross_entropy(logits, batch["y"], batch["mask"])
                return ce + method.loss(tr, frozen, batch, key)

            updates, opt_state = tx.update(jax.grad(loss_fn)(trainable), opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state

        for i in range(steps):
            trainable, opt_state = step(trainable, opt_state, jax.random.key(i))
        state = method.end_task(state, trainable, frozen, task)
    return state


@pytest.fixture(scope="module")
def trained(stream):
    """``trained(name) -> (method, state after both tasks)``, computed once per method."""
    model, variables, tasks = stream
    cache = {}

    def get(name):
        if name not in cache:
            method = FACTORIES[name](model.apply)
            cache[name] = method, _loop(method, variables, tasks)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_method_runs_from_a_users_loop_and_its_state_is_a_pytree(stream, trained, name):
    _, _, tasks = stream
    method, state = trained(name)
    assert isinstance(state, continual.ContinualState)
    # the state survives jit (a pytree of arrays) unchanged
    again, host = jax.jit(lambda s: s)(state), jax.device_get(state)
    for copy in (again, host):
        assert jax.tree.structure(copy) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(copy), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "head" not in state.params["params"] and set(state.head) == {"kernel", "bias"}
    logits, selected = method.predict(state, tasks[1].x[:8])
    assert logits.shape == (8, 10) and np.all(np.isfinite(np.asarray(logits)))
    assert (selected is not None) == (name == "gr_lora")
    # the kernels hold W0 plus every consolidated update (merged methods: the sum of ΔW_t)
    k = "params/dense_0/kernel"
    assert set(state.kernels) == {"params/dense_0/kernel", "params/dense_1/kernel"}
    moved = np.asarray(get_path(state.params, k)) - np.asarray(state.kernels[k])
    assert np.abs(moved).max() > 0


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_features_through_the_head_are_predicts_logits(stream, trained, name):
    """``features`` is what ``state.head`` reads in ``predict``: ``f W + b`` is its logits
    (GR-LoRA: for each task id, and per example for the module its entropy rule selects)."""
    _, _, tasks = stream
    method, state = trained(name)
    x = np.concatenate([tasks[0].x[:8], tasks[1].x[:8]])
    head = {k: np.asarray(v, np.float64) for k, v in state.head.items()}
    per_task = {}
    for task_id in (None, 0, 1) if name == "gr_lora" else (None,):
        logits, _ = method.predict(state, x, task_id=task_id)
        f = np.asarray(method.features(state, x, task_id=task_id), np.float64)
        assert f.shape == (16, 16)
        np.testing.assert_allclose(f @ head["kernel"] + head["bias"], logits, atol=1e-5)
        per_task[task_id] = f
    if name == "gr_lora":  # the modules' features differ, and the selected ones are picked
        assert np.abs(per_task[0] - per_task[1]).max() > 1e-3
        _, selected = method.predict(state, x)
        picked = np.where(np.asarray(selected)[:, None] == 0, per_task[0], per_task[1])
        np.testing.assert_array_equal(per_task[None], picked)
    wrapped = continual.with_head(method, head=continual.PrototypeHead())
    inner_state = state._replace(extra=HeadState(state.extra, None))
    np.testing.assert_array_equal(wrapped.features(inner_state, x), per_task[None])


def test_head_features_for_linen_nnx_and_plain_functions():
    """The head's input after what apply_fn does to its output: a token classifier's last token
    (linen), an nnx model and a plain function (the rows reaching the head's kernel)."""
    import flax.linen as nn
    from flax import nnx

    class Tokens(nn.Module):  # (b, t, n) -> per-token logits, as an LM's lm_head
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, use_bias=False, name="head")(jnp.tanh(nn.Dense(5)(x)))

    def last_token(v, t):
        return Tokens().apply(v, t)[:, -1]

    tokens = jax.random.normal(jax.random.key(0), (4, 3, 6))
    variables = Tokens().init(jax.random.key(1), tokens)
    f = jax.jit(lambda v, t: head_features(last_token, "params/head", v, t))(variables, tokens)
    assert f.shape == (4, 5)
    np.testing.assert_allclose(
        f @ variables["params"]["head"]["kernel"], last_token(variables, tokens), atol=1e-6
    )

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(6, 5, rngs=rngs)
            self.head = nnx.Linear(5, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.body(x)))

    net = Net(nnx.Rngs(0))
    graphdef, state = nnx.split(net)
    x = jax.random.normal(jax.random.key(2), (7, 6))
    f = head_features(lambda s, a: nnx.merge(graphdef, s)(a), "head", state, x)
    np.testing.assert_allclose(f, jax.nn.relu(net.body(x)), rtol=1e-6)

    def plain(params, x):  # tokens (b, t, n) reach the head: one row per example is needed
        return (jnp.tanh(x) @ params["head"]["kernel"])[:, -1]

    params = {"head": {"kernel": jnp.ones((6, 3))}}
    np.testing.assert_array_equal(head_features(plain, "head", params, x[:, None]), jnp.tanh(x))
    with pytest.raises(ValueError, match="one row per example"):
        head_features(plain, "head", params, jnp.stack([x, x], 1))


def test_state_survives_checkpoint_restore(stream, trained, tmp_path):
    from experiments.common import checkpoint

    _, _, tasks = stream
    for name in ("saber", "gr_lora", "gpm_lora", "sd_lora"):
        method, state = trained(name)
        manager = checkpoint.make_manager(tmp_path / name, every=1)
        checkpoint.save(manager, 1, state, meta={}, force=True)
        manager.wait_until_finished()
        restored, _ = checkpoint.restore_latest(manager, state)
        manager.close()
        assert jax.tree.structure(restored) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(
            method.predict(restored, tasks[0].x[:8])[0], method.predict(state, tasks[0].x[:8])[0]
        )


def test_projection_methods_keep_a_off_the_memory(stream, trained):
    """GPM-LoRA and InfLoRA start A ⟂ M, so an input the memory spans sees no new update."""
    _, _, tasks = stream
    for name in ("gpm_lora", "inflora"):
        method, state = trained(name)
        k = "params/dense_0/kernel"
        # the memory is shaped like the params: a SubspaceMemory at each kernel, None elsewhere
        memories = named_leaves(state.memory, is_leaf=is_memory)
        assert list(memories) == list(named_leaves(state.params))
        assert [p for p, m in memories.items() if m is not None] == sorted(state.kernels)
        assert int(get_path(state.memory, k).size) > 0
        trainable, frozen, tx = method.begin_task(
            state, jax.random.key(5), tasks[1]._replace(index=2)
        )
        a = frozen["a"][k] if name == "inflora" else trainable["shared"][k].factors["a"]
        basis = np.asarray(get_path(state.memory, k).basis, np.float64)
        np.testing.assert_allclose(basis.T @ np.asarray(a, np.float64), 0.0, atol=1e-5)
        if name == "gpm_lora":  # the transform's memory is shaped like the trainable pytree
            (projection,) = optax.tree_utils.tree_get_all_with_path(
                tx.init(trainable), "OrthogonalProjectionState"
            )
            placed = named_leaves(projection[1].memory, is_leaf=is_memory)
            assert [p for p, m in placed.items() if m is not None] == [
                f"shared/{kernel}/factors/a" for kernel in sorted(state.kernels)
            ]
            assert placed[f"shared/{k}/factors/a"] is get_path(state.memory, k)


def test_sd_lora_kernel_is_base_plus_scaled_unit_directions(trained):
    _, state = trained("sd_lora")
    k = "params/dense_1/kernel"
    dirs = np.asarray(state.extra.directions[k], np.float64)
    mags = np.asarray(state.extra.magnitudes[k], np.float64)
    assert dirs.shape[0] == 2 == mags.shape[0]
    np.testing.assert_allclose(np.linalg.norm(dirs.reshape(2, -1), axis=1), 1.0, rtol=1e-5)
    ref = np.asarray(state.kernels[k], np.float64) + np.einsum("t,tnm->nm", mags, dirs)
    np.testing.assert_allclose(get_path(state.params, k), ref, atol=1e-5)


def test_o_lora_penalty_is_zero_first_then_measures_overlap(stream):
    model, variables, tasks = stream
    method = FACTORIES["o_lora"](model.apply)
    state = method.init(variables)
    trainable, frozen, _ = method.begin_task(state, jax.random.key(0), tasks[0])
    assert float(method.loss(trainable, frozen, None, None)) == 0.0
    state = method.end_task(state, trainable, frozen, tasks[0])
    trainable, frozen, _ = method.begin_task(state, jax.random.key(1), tasks[1])
    ref = sum(
        np.sum((np.asarray(frozen["old_a"][k][0]).T @ np.asarray(ad.factors["a"])) ** 2)
        for k, ad in trainable["shared"].items()
    )
    np.testing.assert_allclose(
        float(method.loss(trainable, frozen, None, None)), 0.5 * ref, rtol=1e-4
    )


def test_gr_lora_wiring_is_a_beside_shared_a_reading_shared_b():
    model = models.MLP((6,), 3)
    x = jax.random.normal(jax.random.key(0), (5, 4))
    variables = model.init(jax.random.key(1), x)
    rules = [(r"params/dense_0/kernel", adapters.lora(2, alpha=2.0))]
    shared = adapters.init(jax.random.key(2), variables, rules)
    k = "params/dense_0/kernel"
    shared = {k: shared[k].replace(factors={**shared[k].factors, "b": jnp.ones((2, 6))})}
    module = adapters.init(jax.random.key(3), variables, rules)  # its own b is never read
    out = adapters.adapt(model.apply)(variables, continual.gr_lora_adapters(shared, module), x)
    p = variables["params"]
    a, a_mod, b = shared[k].factors["a"], module[k].factors["a"], shared[k].factors["b"]
    h = jax.nn.relu(x @ p["dense_0"]["kernel"] + p["dense_0"]["bias"] + x @ (a + a_mod) @ b)
    np.testing.assert_allclose(out, h @ p["head"]["kernel"] + p["head"]["bias"], atol=1e-5)
    with pytest.raises(ValueError, match="no shared adapter"):
        module_adapters(module, {})


def test_layer_inputs_for_nnx_and_plain_functions():
    from flax import nnx

    x = jax.random.normal(jax.random.key(0), (7, 6))
    w1, w2 = (
        jax.random.normal(jax.random.key(1), (6, 5)),
        jax.random.normal(jax.random.key(2), (5, 3)),
    )

    def plain(params, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    params = {"w1": w1, "w2": w2}
    out, inputs = jax.jit(lambda p, a: continual.layer_inputs(plain, ("w1", "w2"), p, a))(params, x)
    np.testing.assert_allclose(inputs["w1"], x, rtol=1e-6)
    np.testing.assert_allclose(inputs["w2"], jnp.tanh(x @ w1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, plain(params, x), rtol=1e-6)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(6, 5, rngs=rngs)
            self.second = nnx.Linear(5, 3, rngs=rngs)

        def __call__(self, x):
            return self.second(jax.nn.relu(self.first(x)))

    net = Net(nnx.Rngs(0))
    graphdef, state = nnx.split(net)
    names = [p for p in named_leaves(state) if "kernel" in p]
    _, inputs = continual.layer_inputs(lambda s, a: nnx.merge(graphdef, s)(a), names, state, x)
    first = [n for n in names if "first" in n][0]
    second = [n for n in names if "second" in n][0]
    np.testing.assert_allclose(inputs[first], x, rtol=1e-6)
    np.testing.assert_allclose(inputs[second], jax.nn.relu(net.first(x)), rtol=1e-5, atol=1e-6)


def test_layer_inputs_of_a_stack_inside_lax_scan_and_remat():
    # A plain function scanning stacked kernels w: (L, n, n) (as nn.scan does): every layer's
    # input, recorded inside the (rematerialised) body, comes out stacked (L, b, n), exactly.
    w = jax.random.normal(jax.random.key(1), (3, 4, 4)) / 2
    head = jax.random.normal(jax.random.key(2), (4, 2))
    x = jax.random.normal(jax.random.key(0), (2, 5, 4))  # (b, t, n): tokens are flattened

    def plain(params, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(jax.checkpoint(layer), x, params["w"])
        return h[:, -1] @ params["head"]

    params = {"w": w, "head": head}
    out, inputs = jax.jit(lambda p, a: continual.layer_inputs(plain, ("w", "head"), p, a))(
        params, x
    )
    h, want = x, []
    for i in range(3):
        want.append(h.reshape(-1, 4))
        h = jnp.tanh(h @ w[i])
    assert inputs["w"].shape == (3, 10, 4) and inputs["head"].shape == (2, 4)
    np.testing.assert_allclose(inputs["w"], jnp.stack(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inputs["head"], h[:, -1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, plain(params, x), rtol=1e-6)
    with pytest.raises(ValueError, match="never used"):
        continual.layer_inputs(lambda p, a: a @ p["head"], ("w",), params, x[:, -1])
    with pytest.raises(ValueError, match="no floating-point output"):  # not silent zeros
        continual.layer_inputs(lambda p, a: jnp.argmax(plain(p, a), -1), ("w",), params, x)


def test_projection_before_adam_is_detected():
    params = {"a": jnp.ones((4, 2))}
    memory = {"a": optim.init_subspace_memory(4)}
    good = optax.chain(optax.scale_by_adam(), optim.scale_by_orthogonal_projection(memory))
    check_projection_order(good.init(params))
    bad = optax.chain(optim.scale_by_orthogonal_projection(memory), optax.adam(1e-3))
    with pytest.raises(ValueError, match="chained before ScaleByAdamState"):
        check_projection_order(bad.init(params))
    masked = optax.chain(
        optax.masked(optim.scale_by_orthogonal_projection(memory), {"a": True}), optax.rmsprop(1.0)
    )
    with pytest.raises(ValueError, match="Chain the projection after"):
        check_projection_order(masked.init(params))


def test_factories_reject_bad_hyper_parameters():
    f = models.MLP((4,), 2).apply
    with pytest.raises(ValueError, match="rank >= 2"):
        continual.saber(f, targets=TARGETS, rank=1)
    with pytest.raises(ValueError, match="memory_threshold"):
        continual.inflora(f, targets=TARGETS, memory_threshold=1.5)
    with pytest.raises(ValueError, match="lambda_orth"):
        continual.o_lora(f, targets=TARGETS, lambda_orth=-1.0)
    with pytest.raises(ValueError, match="targets"):
        continual.sequential_lora(f, targets="params/dense_0/kernel")
    with pytest.raises(ValueError, match="match no kernel"):
        continual.sequential_lora(f, targets=("params/nope",)).init(
            models.MLP((4,), 2).init(jax.random.key(0), jnp.zeros((1, 3)))
        )


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_method_checks_rank_and_head_path_at_init_naming_what_was_typed(stream, name):
    _, variables, _ = stream  # kernels (64, 16) and (16, 16): a rank above 16 fits none
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(KW, "rank", 20)
        big = FACTORIES[name](models.MLP((16, 16), 10).apply)
    with pytest.raises(ValueError) as err:
        big.init(variables)
    assert str(err.value).startswith(
        "rank=20 exceeds min(n, m) = 16 of the targeted kernel 'params/dense_0/kernel' (a 64x16"
    ), str(err.value)
    # A model whose classifier is not at params/head: init names head_path and what there is.
    renamed = {"params": {**variables["params"]}}
    renamed["params"]["classifier"] = renamed["params"].pop("head")
    with pytest.raises(ValueError) as err:
        FACTORIES[name](models.MLP((16, 16), 10).apply).init(renamed)
    assert str(err.value) == (
        "head_path='params/head' is not in the model: params holds 'params/classifier', "
        "'params/dense_0', 'params/dense_1'; pass head_path= the path of the classifier head's "
        "parameters."
    )


class _Rows:
    """A row-sliceable stand-in for an array that records the most rows read at once and refuses
    to be converted whole (as :class:`lowrank_jax.data.ImageRows` stands in for a dataset)."""

    def __init__(self, x):
        self._x, self.most = x, 0

    def __len__(self):
        return len(self._x)

    def __getitem__(self, index):
        out = self._x[index]
        self.most = max(self.most, len(out))
        return out

    def __array__(self, *args, **kwargs):
        raise AssertionError("the whole task was converted to an array")


@pytest.mark.parametrize("name", ["saber", "gr_lora", "inflora"])
def test_methods_and_heads_read_a_task_a_batch_at_a_time(stream, trained, name):
    """A task whose inputs are read on demand gives the state of the same task held in memory,
    with at most one feature batch (256 rows) read at once, for the method and its aligned head;
    evaluation reads test sets a batch at a time too."""
    model, variables, tasks = stream
    lazy = [t._replace(x=_Rows(t.x)) for t in tasks]
    method = FACTORIES[name](model.apply)
    if name == "saber":
        method = continual.with_head(method, head=continual.AlignedHead(num_per_class=8))
        want = _loop(method, variables, tasks)
    else:
        want = trained(name)[1]
    got = _loop(method, variables, lazy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert 0 < max(t.x.most for t in lazy) <= 256 < len(tasks[0].x)
    tests = [{"x": _Rows(t.x), "y": t.y} for t in tasks]
    accs, _ = evaluate_tasks(
        method, got, tests, [t.classes for t in tasks], num_classes=10, batch_size=64
    )
    want_accs, _ = evaluate_tasks(
        method,
        got,
        [{"x": t.x, "y": t.y} for t in tasks],
        [t.classes for t in tasks],
        num_classes=10,
        batch_size=64,
    )
    assert accs == want_accs and max(t["x"].most for t in tests) == 64
