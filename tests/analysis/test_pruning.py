"""P19 JBR pruning: known answers on a one-hidden-layer ReLU MLP, masking, the pruning schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import analysis
from lowrank_jax.analysis.pruning import (
    PruneGroup,
    init_masks,
    prune_step,
    score_exact_tpv,
    score_taylor,
)
from lowrank_jax.models import MLP

H, C = 6, 3


def _model(features=(H,)):
    model = MLP(features, C)
    x = jax.random.normal(jax.random.key(0), (16, 5))
    params = model.init(jax.random.key(1), x)
    return model, params, x


def _np_forward(params, x):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)["params"]
    h = np.maximum(np.asarray(x, np.float64) @ p["dense_0"]["kernel"] + p["dense_0"]["bias"], 0)
    return h, h @ p["head"]["kernel"] + p["head"]["bias"]


def test_masking_equals_removing_the_unit():
    model, params, x = _model()
    groups = analysis.mlp_groups(params)
    masks = init_masks(params, groups)
    masks["dense_0"] = masks["dense_0"].at[jnp.array([1, 4])].set(0.0)
    got = model.apply(analysis.apply_masks(params, masks, groups), x)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)["params"]
    keep = np.array([0, 2, 3, 5])
    h = np.maximum(
        np.asarray(x, np.float64) @ p["dense_0"]["kernel"][:, keep] + p["dense_0"]["bias"][keep], 0
    )
    want = h @ p["head"]["kernel"][keep] + p["head"]["bias"]
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_exact_tpv_known_answer():
    # Scaling unit c's in- and out-weights by (1 + ε) changes f by 2ε V_c relu(z_c) to first
    # order (relu'(z) z = relu(z)), so E_x‖J u_c‖² = 4 E_x relu(z_c)² ‖V_c‖².
    model, params, x = _model()
    groups = analysis.mlp_groups(params)
    got = score_exact_tpv(model.apply, params, x, groups, chunk=5)["dense_0"]
    h, _ = _np_forward(params, x)
    v = np.asarray(params["params"]["head"]["kernel"], np.float64)
    want = 4 * np.mean(h**2, 0) * np.sum(v**2, 1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-7)


def test_jacobian_score_known_answer():
    # For ReLU both halves of the score equal a_c = mean_i h_ic (p_i − y_i)·V_c: score = 2 a_c².
    model, params, x = _model()
    groups = analysis.mlp_groups(params)
    y = jnp.arange(16) % C
    got = analysis.score_jacobian(model.apply, params, x[None], y[None], groups)["dense_0"]
    h, logits = _np_forward(params, x)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    r = p - np.eye(C)[np.asarray(y)]
    v = np.asarray(params["params"]["head"]["kernel"], np.float64)
    a = np.mean(h * (r @ v.T), 0)
    np.testing.assert_allclose(np.asarray(got), 2 * a**2, rtol=1e-4, atol=1e-9)
    # Two identical batches double the score.
    got2 = analysis.score_jacobian(
        model.apply, params, jnp.stack([x, x]), jnp.stack([y, y]), groups
    )
    np.testing.assert_allclose(np.asarray(got2["dense_0"]), 4 * a**2, rtol=1e-4, atol=1e-9)


def test_l1_and_taylor_definitions():
    model, params, x = _model((H, 4))
    groups = analysis.mlp_groups(params)
    assert groups == (
        PruneGroup("dense_0", "dense_1"),
        PruneGroup("dense_1", "head"),
    )
    p = params["params"]
    l1 = analysis.score_l1(params, groups)
    want = np.abs(p["dense_0"]["kernel"]).sum(0) + np.abs(p["dense_1"]["kernel"]).sum(1)
    np.testing.assert_allclose(np.asarray(l1["dense_0"]), want, rtol=1e-6)
    y = jnp.arange(16) % C
    g = jax.grad(
        lambda q: optax.softmax_cross_entropy_with_integer_labels(model.apply(q, x), y).mean()
    )(params)["params"]
    ty = score_taylor(model.apply, params, x, y, groups)["dense_1"]
    want = np.abs(p["dense_1"]["kernel"] * g["dense_1"]["kernel"]).sum(0) + np.abs(
        p["head"]["kernel"] * g["head"]["kernel"]
    ).sum(1)
    np.testing.assert_allclose(np.asarray(ty), want, rtol=1e-5)


def test_prune_step_and_schedule():
    masks = {"a": jnp.ones(4), "b": jnp.ones(2)}
    scores = {"a": jnp.array([4.0, 1.0, 3.0, 2.0]), "b": jnp.array([0.1, 5.0])}
    # Layer-mean normalised: a -> [1.6, .4, 1.2, .8], b -> [.04, 1.96].
    out = prune_step(scores, masks, num_pruned=2)
    np.testing.assert_array_equal(np.asarray(out["a"]), [1, 0, 1, 1])
    np.testing.assert_array_equal(np.asarray(out["b"]), [0, 1])
    out = prune_step(scores, out, num_pruned=4)  # b keeps its last unit
    np.testing.assert_array_equal(np.asarray(out["b"]), [0, 1])
    assert int(out["a"].sum()) == 1
    with pytest.raises(ValueError, match="num_pruned"):
        prune_step(scores, masks, num_pruned=5)

    model, params, _ = _model((8, 8))
    groups = analysis.mlp_groups(params)
    hist = analysis.prune_iteratively(
        params, groups, lambda p, m, s: analysis.score_l1(p, groups), target_ratio=0.75, steps=4
    )
    counts = [sum(int((1 - m[k]).sum()) for k in m) for m in hist]
    assert counts == [3, 6, 9, 12]
    for prev, nxt in zip(hist[:-1], hist[1:], strict=True):  # pruned units stay pruned
        for k in prev:
            assert np.all(np.asarray(nxt[k]) <= np.asarray(prev[k]))


def test_pseudo_labels_and_bad_inputs():
    model, params, x = _model()
    with pytest.raises(ValueError, match="threshold"):
        analysis.confident_pseudo_labels(
            model.apply,
            params,
            x,
            key=jax.random.key(0),
            num_batches=1,
            batch_size=4,
            threshold=1.0,
        )
    xb, yb = analysis.confident_pseudo_labels(
        model.apply, params, x, key=jax.random.key(0), num_batches=2, batch_size=3, threshold=0.0
    )
    assert xb.shape == (2, 3, 5)
    np.testing.assert_array_equal(
        np.asarray(yb),
        np.asarray(jnp.argmax(model.apply(params, xb.reshape(6, 5)), -1)).reshape(2, 3),
    )
    with pytest.raises(ValueError, match="MLP"):
        analysis.mlp_groups({"params": {"head": {}}})
