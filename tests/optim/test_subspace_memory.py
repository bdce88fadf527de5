"""scale_by_orthogonal_projection and the subspace memory against their definitions (float64 NumPy)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters, models
from lowrank_jax.adapters.paths import named_leaves, path_to_str
from lowrank_jax.optim import (
    OrthogonalProjectionState,
    SubspaceMemory,
    captured_energy,
    extend_subspace_memory,
    init_subspace_memory,
    project_onto,
    scale_by_orthogonal_projection,
)
from lowrank_jax.optim.orthogonal_projection import init_memories, is_memory
from lowrank_jax.optim.subspace_memory import project_off
from lowrank_jax.spectral.svd import left_singular

TOL = dict(rtol=1e-5, atol=1e-5)


def _orthonormal(rng, n, k):
    q, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return q


def _memory(q, capacity):
    n, k = q.shape
    basis = np.zeros((n, capacity))
    basis[:, :k] = q
    return SubspaceMemory(jnp.asarray(basis, jnp.float32), jnp.asarray(k, jnp.int32))


def test_project_off_is_idempotent_orthogonal_and_matches_reference():
    rng = np.random.default_rng(0)
    q = _orthonormal(rng, 12, 4)
    mem = _memory(q, capacity=7)  # zero padding must not change the projector
    g = rng.standard_normal((12, 3))
    out = np.asarray(jax.jit(project_off)(mem, jnp.asarray(g, jnp.float32)), np.float64)
    np.testing.assert_allclose(out, g - q @ (q.T @ g), **TOL)
    np.testing.assert_allclose(q.T @ out, 0.0, atol=1e-5)
    twice = np.asarray(project_off(mem, jnp.asarray(out, jnp.float32)))
    np.testing.assert_allclose(twice, out, **TOL)
    onto = np.asarray(project_onto(mem, jnp.asarray(g, jnp.float32)))
    np.testing.assert_allclose(onto + out, g, **TOL)
    vec = np.asarray(project_off(mem, jnp.asarray(g[:, 0], jnp.float32)))
    np.testing.assert_allclose(vec, out[:, 0], **TOL)


def test_extend_memory_follows_gpm_energy_criterion():
    rng = np.random.default_rng(1)
    n, b = 10, 40
    # inputs with a decaying spectrum
    x = rng.standard_normal((b, n)) * (0.6 ** np.arange(n))
    threshold = 0.9
    mem = init_subspace_memory(n, capacity=n)
    mem = extend_subspace_memory(mem, jnp.asarray(x, jnp.float32), threshold=threshold)
    # reference: smallest k with sum_{i<k} s_i^2 >= tau * ||X||^2
    s = np.linalg.svd(x.T, compute_uv=False)
    k = int(np.argmax(np.cumsum(s**2) >= threshold * np.sum(s**2)) + 1)
    assert int(mem.size) == k
    basis = np.asarray(mem.basis, np.float64)
    np.testing.assert_allclose(basis[:, :k].T @ basis[:, :k], np.eye(k), atol=1e-5)
    np.testing.assert_allclose(basis[:, k:], 0.0)
    u = np.linalg.svd(x.T)[0][:, :k]
    np.testing.assert_allclose(u @ u.T, basis @ basis.T, atol=1e-4)  # same subspace
    energy = float(captured_energy(mem, jnp.asarray(x, jnp.float32)))
    assert energy >= threshold - 1e-5
    # second task: only the residual directions are added, old columns unchanged
    y = rng.standard_normal((b, n))
    mem2 = extend_subspace_memory(mem, jnp.asarray(y, jnp.float32), threshold=0.95)
    basis2 = np.asarray(mem2.basis, np.float64)
    np.testing.assert_allclose(basis2[:, :k], basis[:, :k], atol=1e-6)
    size2 = int(mem2.size)
    np.testing.assert_allclose(basis2[:, :size2].T @ basis2[:, :size2], np.eye(size2), atol=1e-4)
    assert float(captured_energy(mem2, jnp.asarray(y, jnp.float32))) >= 0.95 - 1e-4
    # already-spanned inputs add nothing
    mem3 = extend_subspace_memory(
        mem2, jnp.asarray(x[:, :] @ (basis2 @ basis2.T), jnp.float32), threshold=0.95
    )
    assert int(mem3.size) == size2


def test_extend_memory_respects_capacity_and_stack():
    rng = np.random.default_rng(2)
    mem = init_subspace_memory(6, capacity=2, stack=(3,))
    x = rng.standard_normal((3, 20, 6))
    new = jax.jit(lambda m, a: extend_subspace_memory(m, a, threshold=0.999))(mem, x)
    assert new.basis.shape == (3, 6, 2)
    np.testing.assert_array_equal(np.asarray(new.size), [2, 2, 2])
    for i in range(3):
        q = np.asarray(new.basis[i], np.float64)
        np.testing.assert_allclose(q.T @ q, np.eye(2), atol=1e-5)
        top = np.linalg.svd(x[i].T)[0][:, :2]  # most energetic directions are the ones kept
        np.testing.assert_allclose(top @ top.T, q @ q.T, atol=1e-4)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="capacity"):
        init_subspace_memory(4, capacity=5)
    mem = init_subspace_memory(4)
    with pytest.raises(ValueError, match="threshold"):
        extend_subspace_memory(mem, jnp.ones((3, 4)), threshold=1.5)
    with pytest.raises(ValueError, match="do not fit"):
        extend_subspace_memory(mem, jnp.ones((3, 5)), threshold=0.9)
    with pytest.raises(ValueError, match="does not fit"):
        project_off(mem, jnp.ones((5, 2)))
    with pytest.raises(TypeError, match="SubspaceMemory"):
        project_off(jnp.ones((4, 2)), jnp.ones((4, 2)))


def _adapter_params():
    model = models.MLP((16, 16), 3)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8)))
    return adapters.init(jax.random.key(1), variables, [(r".*dense_\d/kernel", adapters.lora(4))])


def _placed(params, path, memory):
    """A memory tree shaped like ``params``: ``memory`` at ``path``, None elsewhere."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: memory if path_to_str(kp) == path else None, params
    )


def test_transform_in_chain_keeps_factor_off_memory():
    rng = np.random.default_rng(3)
    params = _adapter_params()
    q = _orthonormal(rng, 8, 3)
    key = "params/dense_0/kernel/factors/a"
    mem = _memory(q, capacity=5)
    memory = _placed(params, key, mem)
    # A starts off the memory (InfLoRA/GPM-style initialisation)
    a0 = params["params/dense_0/kernel"].factors["a"]
    params["params/dense_0/kernel"].factors["a"] = project_off(mem, a0)
    tx = optax.chain(
        optax.scale_by_adam(), scale_by_orthogonal_projection(memory), optax.scale(-0.1)
    )
    state = tx.init(params)
    proj_state = state[1]
    assert isinstance(proj_state, OrthogonalProjectionState)
    assert proj_state._fields[0] == "count"

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, updates

    for i in range(3):
        g = jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape), params)
        raw, _ = optax.chain(optax.scale_by_adam(), optax.scale(-0.1)).update(
            g, optax.chain(optax.scale_by_adam(), optax.scale(-0.1)).init(params)
        )
        params, state, updates = step(params, state, g)
        u = np.asarray(updates["params/dense_0/kernel"].factors["a"], np.float64)
        np.testing.assert_allclose(q.T @ u, 0.0, atol=1e-5)
        # untargeted leaves are untouched (same Adam update as without projection at step 0)
        if i == 0:
            np.testing.assert_allclose(
                updates["params/dense_1/kernel"].factors["a"],
                raw["params/dense_1/kernel"].factors["a"],
                **TOL,
            )
    a = np.asarray(params["params/dense_0/kernel"].factors["a"], np.float64)
    np.testing.assert_allclose(q.T @ a, 0.0, atol=1e-5)
    assert int(state[1].count) == 3


def test_empty_memories_from_targets_and_tree_set():
    params = _adapter_params()
    tx = scale_by_orthogonal_projection(capacity=4)
    state = tx.init(params)
    # shaped like the params: a memory at each `a` factor, None at every other leaf
    memories = named_leaves(state.memory, is_leaf=is_memory)
    assert list(memories) == list(named_leaves(params))
    assert [p for p, m in memories.items() if m is not None] == [
        "params/dense_0/kernel/factors/a",
        "params/dense_1/kernel/factors/a",
    ]
    assert state.memory["params/dense_0/kernel"].factors["a"].basis.shape == (8, 4)
    assert state.memory["params/dense_1/kernel"].factors["a"].basis.shape == (16, 4)
    # an empty memory projects nothing
    g = jax.tree.map(jnp.ones_like, params)
    out, _ = tx.update(g, state)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(g), strict=True):
        np.testing.assert_allclose(a, b)
    # fill one memory between tasks through optax.tree_utils.tree_set
    x = jax.random.normal(jax.random.key(0), (30, 8))
    ad = state.memory["params/dense_0/kernel"]
    filled = extend_subspace_memory(ad.factors["a"], x, threshold=0.9)
    mem = {**state.memory, "params/dense_0/kernel": ad.replace(factors={**ad.factors, "a": filled})}
    chained = optax.chain(optax.identity(), tx)
    cstate = optax.tree_utils.tree_set(chained.init(params), memory=mem)
    out, _ = chained.update(g, cstate)
    basis = np.asarray(filled.basis)
    assert int(filled.size) > 0
    a_out = np.asarray(out["params/dense_0/kernel"].factors["a"])
    np.testing.assert_allclose(basis.T @ a_out, 0.0, atol=1e-5)
    assert np.abs(a_out - 1.0).max() > 0.1  # it was projected


def test_transform_errors():
    params = _adapter_params()
    with pytest.raises(ValueError, match="match no parameter"):
        scale_by_orthogonal_projection(targets="nothing").init(params)
    a = "params/dense_0/kernel/factors/a"
    with pytest.raises(ValueError, match="shaped like the params"):  # keyed by path: no longer
        scale_by_orthogonal_projection({a: init_subspace_memory(8)}).init(params)
    with pytest.raises(ValueError, match="not at a parameter"):
        memory = _placed(params, a, None)
        memory["params/dense_0/kernel"] = init_subspace_memory(8)
        scale_by_orthogonal_projection(memory).init(params)
    with pytest.raises(ValueError, match="does not fit"):
        scale_by_orthogonal_projection(_placed(params, a, init_subspace_memory(5))).init(params)
    with pytest.raises(TypeError, match="SubspaceMemory"):
        scale_by_orthogonal_projection(_placed(params, a, jnp.eye(8))).init(params)


def test_memory_state_survives_jit_device_get_and_orbax(tmp_path):
    import orbax.checkpoint as ocp

    params = _adapter_params()
    x = jax.random.normal(jax.random.key(0), (30, 8))
    tx = optax.chain(optax.scale_by_adam(), scale_by_orthogonal_projection(), optax.scale(-0.1))
    state = tx.init(params)
    state = optax.tree_utils.tree_set(
        state,
        memory=jax.tree.map(
            lambda m: m if m is None or m.basis.shape[0] != 8
            else extend_subspace_memory(m, x, threshold=0.9),
            state[1].memory,
            is_leaf=is_memory,
        ),
    )  # fmt: skip
    g = jax.tree.map(jnp.ones_like, params)
    want, _ = tx.update(g, state, params)
    again, host = jax.jit(lambda s: s)(state), jax.device_get(state)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(
            tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        )
    for copy in (again, host, restored):
        assert jax.tree.structure(copy) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(copy), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        got, _ = jax.jit(tx.update)(g, copy, params)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(restored[1].memory["params/dense_0/kernel"].factors["a"].size) > 0


@pytest.mark.parametrize("shape", [(6, 40), (6, 4)])
def test_left_singular_matches_svd_for_wide_and_tall(shape):
    r = jax.random.normal(jax.random.key(3), shape) * jnp.linspace(3.0, 0.5, shape[0])[:, None]
    u, s = left_singular(r)
    u_ref, s_ref, _ = np.linalg.svd(np.asarray(r, np.float64), full_matrices=False)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4)
    # the same subspaces up to sign: |u_iᵀ u_ref_i| = 1
    np.testing.assert_allclose(np.abs(np.sum(np.asarray(u) * u_ref, axis=0)), 1.0, atol=1e-4)


def test_left_singular_falls_back_to_the_gram_matrix_when_svd_fails(monkeypatch):
    r = jax.random.normal(jax.random.key(4), (5, 30))
    u_ref, s_ref = left_singular(r)
    nan_svd = lambda a, full_matrices: tuple(  # noqa: E731
        jnp.full_like(x, jnp.nan) for x in np.linalg.svd(np.asarray(a), full_matrices=False)
    )
    monkeypatch.setattr(jnp.linalg, "svd", nan_svd)
    u, s = left_singular(r)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4)
    np.testing.assert_allclose(np.abs(np.sum(np.asarray(u) * np.asarray(u_ref), 0)), 1.0, atol=1e-4)


def test_fill_memories_from_layer_inputs_keyed_by_kernel_path():
    from lowrank_jax import continual, optim

    model = models.MLP((16, 16), 4)
    x = jax.random.normal(jax.random.key(1), (40, 8))
    variables = model.init(jax.random.key(0), x[:1])
    ads = adapters.init(jax.random.key(2), variables, [(r".*dense_\d+/kernel", adapters.lora(2))])
    kernels = ["params/dense_0/kernel", "params/dense_1/kernel"]
    _, inputs = continual.layer_inputs(model.apply, kernels, variables, x)
    # The projection inside an optax chain, and gradient recycling under masked: both filled.
    tx = optax.chain(optax.scale_by_adam(), scale_by_orthogonal_projection(), optax.scale(-0.1))
    filled = optim.fill_memories(tx.init(ads), inputs, threshold=0.9)
    memory = filled[1].memory
    for kernel in kernels:
        want = extend_subspace_memory(
            init_subspace_memory(inputs[kernel].shape[1]), inputs[kernel], threshold=0.9
        )
        got = memory[kernel].factors["a"]
        np.testing.assert_array_equal(got.basis, want.basis)
        assert int(got.size) == int(want.size) > 0
    # The filled state projects: an update of A leaves the recorded inputs' outputs unchanged.
    g = jax.tree.map(jnp.ones_like, ads)
    updates, _ = tx.update(g, filled, ads)
    a0 = np.asarray(updates["params/dense_0/kernel"].factors["a"])
    basis = np.asarray(memory["params/dense_0/kernel"].factors["a"].basis)
    np.testing.assert_allclose(basis.T @ a0, 0.0, atol=1e-5)
    shared = {"shared": ads, "module": ads}
    recycle = optax.masked(optim.scale_by_gradient_recycling(), {"shared": True, "module": True})
    state = optim.fill_memories(recycle.init(shared), inputs, threshold=0.9)
    inner = state.inner_state  # optax.masked's state around the recycling state
    filled_paths = [
        p for p, m in named_leaves(inner.memory, is_leaf=is_memory).items() if m is not None
    ]
    assert filled_paths == [f"shared/{k}/factors/a" for k in kernels]
    assert all(int(inner.memory["shared"][k].factors["a"].size) > 0 for k in kernels)
    # A memory tree of one's own (init_memories) is filled the same way.
    own = optim.fill_memories(
        scale_by_orthogonal_projection(init_memories(ads, r".*/a")).init(ads), inputs, threshold=0.9
    )
    for a, b in zip(jax.tree.leaves(own.memory), jax.tree.leaves(memory), strict=True):
        np.testing.assert_array_equal(a, b)
    # Errors name what is missing.
    with pytest.raises(ValueError, match="'params/dense_1/kernel/factors/a' has no layer inputs"):
        optim.fill_memories(tx.init(ads), {kernels[0]: inputs[kernels[0]]}, threshold=0.9)
    with pytest.raises(ValueError, match="holds no subspace memory"):
        optim.fill_memories(optax.adam(1e-3).init(ads), inputs, threshold=0.9)
