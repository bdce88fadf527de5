"""scale_by_gradient_recycling against its definition: kept ⟂ memory, kept + recycled == update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters, models
from lowrank_jax.adapters.paths import named_leaves
from lowrank_jax.optim import (
    GradientRecyclingState,
    SubspaceMemory,
    init_memories,
    scale_by_gradient_recycling,
)
from lowrank_jax.optim.orthogonal_projection import is_memory
from lowrank_jax.optim.recycling import split_update

TOL = dict(rtol=1e-5, atol=1e-5)
KEY = "params/dense_0/kernel"


def _params():
    model = models.MLP((16,), 3)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8)))
    rules = [(r".*dense_0/kernel", adapters.lora(4))]
    shared = adapters.init(jax.random.key(1), variables, rules)
    module = jax.tree.map(jnp.zeros_like, shared)
    return {"shared": shared, "module": module, "head": jnp.ones((3,))}


def _tree(params, mem):
    """The memory tree of the tests: ``mem`` at the shared ``a`` factor, None elsewhere."""
    ad = params["shared"][KEY]
    shared = {KEY: ad.replace(factors={"a": mem, "b": None})}
    return {"shared": shared, "module": None, "head": None}  # None: a whole unprojected subtree


def _memory(rng, n=8, k=3, capacity=6):
    q, _ = np.linalg.qr(rng.standard_normal((n, k)))
    basis = np.zeros((n, capacity))
    basis[:, :k] = q
    return q, SubspaceMemory(jnp.asarray(basis, jnp.float32), jnp.asarray(k, jnp.int32))


def test_split_update_identity():
    rng = np.random.default_rng(0)
    q, mem = _memory(rng)
    u = rng.standard_normal((8, 4))
    kept, rec = split_update(mem, jnp.asarray(u, jnp.float32))
    np.testing.assert_allclose(np.asarray(kept) + np.asarray(rec), u, **TOL)
    np.testing.assert_allclose(np.asarray(rec), q @ (q.T @ u), **TOL)
    np.testing.assert_allclose(q.T @ np.asarray(kept), 0.0, atol=1e-5)


def test_recycling_routes_discarded_component_to_module():
    rng = np.random.default_rng(1)
    q, mem = _memory(rng)
    params = _params()
    inner = optax.scale_by_adam()
    tx = optax.chain(inner, scale_by_gradient_recycling(_tree(params, mem)), optax.scale(-0.1))
    reference = optax.chain(optax.scale_by_adam(), optax.scale(-0.1))
    state, ref_state = tx.init(params), reference.init(params)
    rec_state = state[1]
    assert isinstance(rec_state, GradientRecyclingState)
    assert rec_state._fields[0] == "count"
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    ref, _ = reference.update(grads, ref_state, params)
    original = np.asarray(ref["shared"][KEY].factors["a"], np.float64)
    kept = np.asarray(updates["shared"][KEY].factors["a"], np.float64)
    recycled = np.asarray(updates["module"][KEY].factors["a"], np.float64)
    np.testing.assert_allclose(kept + recycled, original, **TOL)  # nothing is lost
    np.testing.assert_allclose(q.T @ kept, 0.0, atol=1e-5)  # shared stays interference-free
    np.testing.assert_allclose(recycled, q @ (q.T @ original), **TOL)
    # leaves without a memory pass unchanged (the module's b keeps its own update)
    for a, b in [
        (updates["shared"][KEY].factors["b"], ref["shared"][KEY].factors["b"]),
        (updates["module"][KEY].factors["b"], ref["module"][KEY].factors["b"]),
        (updates["head"], ref["head"]),
    ]:
        np.testing.assert_allclose(a, b, **TOL)
    fraction = np.sum(recycled**2) / np.sum(original**2)
    np.testing.assert_allclose(float(state[1].recycled_fraction), fraction, rtol=1e-4)
    assert int(state[1].count) == 1


def test_zero_recycle_scale_is_pure_projection_and_empty_memory_recycles_nothing():
    rng = np.random.default_rng(2)
    q, mem = _memory(rng)
    path = f"shared/{KEY}/factors/a"
    params = _params()
    g = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    pure = scale_by_gradient_recycling(_tree(params, mem), recycle_scale=0.0)
    out, _ = pure.update(g, pure.init(params))
    np.testing.assert_allclose(out["module"][KEY].factors["a"], 0.0)
    kept = np.asarray(g["shared"][KEY].factors["a"], np.float64)
    np.testing.assert_allclose(out["shared"][KEY].factors["a"], kept - q @ (q.T @ kept), **TOL)
    tx = scale_by_gradient_recycling(capacity=4)  # empty memories from the default targets
    state = tx.init(params)
    memories = named_leaves(state.memory, is_leaf=is_memory)
    assert list(memories) == list(named_leaves(params))  # shaped like the params
    assert [p for p, m in memories.items() if m is not None] == [path]
    out, state = tx.update(g, state)
    np.testing.assert_allclose(out["shared"][KEY].factors["a"], g["shared"][KEY].factors["a"])
    np.testing.assert_allclose(out["module"][KEY].factors["a"], 0.0)
    assert float(state.recycled_fraction) == 0.0


def test_recycling_errors():
    params = _params()
    with pytest.raises(ValueError, match="entries"):
        scale_by_gradient_recycling().init({"shared": params["shared"]})
    bad = dict(params)
    bad["module"] = {}
    with pytest.raises(ValueError, match="counterpart"):
        scale_by_gradient_recycling().init(bad)
    bad["module"] = jax.tree.map(lambda x: jnp.zeros((*x.shape[:-1], 1)), params["module"])
    with pytest.raises(ValueError, match="no module counterpart .* of shape"):
        scale_by_gradient_recycling().init(bad)
    with pytest.raises(ValueError, match="not under the shared entry"):
        scale_by_gradient_recycling(init_memories(params, r"module/.*/a")).init(params)
    with pytest.raises(ValueError, match="shaped like the params"):
        scale_by_gradient_recycling({"shared": None}).init(params)
    with pytest.raises(ValueError, match="recycle_scale"):
        scale_by_gradient_recycling(recycle_scale=-1.0)
