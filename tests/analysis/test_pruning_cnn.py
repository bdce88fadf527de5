"""P19 pruning of conv channels: masking equals deleting, scores against float64 definitions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import analysis
from lowrank_jax.analysis.pruning import (
    PruneGroup,
    init_masks,
    score_exact_tpv,
    score_taylor,
    sequential_groups,
)
from lowrank_jax.models import CNN

C0, C1, H, K = 3, 4, 5, 3  # conv channels, dense units, classes


@functools.cache
def _model(channels=(C0, C1), features=(H,)):
    model = CNN(channels, features, K)
    x = jax.random.uniform(jax.random.key(0), (6, 8, 8, 1))
    params = model.init(jax.random.key(1), x)
    # Non-zero biases, so a bias that is not masked would show.
    rng = np.random.default_rng(2)
    params = jax.tree.map(
        lambda a: jnp.asarray(a + 0.1 * rng.standard_normal(a.shape), jnp.float32), params
    )
    return model, params, x


@functools.cache
def _grad():
    model, params, x = _model()
    y = jnp.arange(6) % K
    g = jax.jit(
        jax.grad(
            lambda q: optax.softmax_cross_entropy_with_integer_labels(model.apply(q, x), y).mean()
        )
    )(params)
    return y, g


_score_taylor = jax.jit(score_taylor, static_argnums=(0, 4))
_score_jac = jax.jit(analysis.score_jacobian, static_argnums=(0, 4))
_score_tpv = jax.jit(score_exact_tpv, static_argnums=(0, 3), static_argnames="chunk")


def _f64(params):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), params)["params"]


def test_groups_of_the_cnn():
    _, params, _ = _model()
    assert sequential_groups(params) == (
        PruneGroup("conv_0", "conv_1"),
        PruneGroup("conv_1", "dense_0"),
        PruneGroup("dense_0", "head"),
    )
    with pytest.raises(ValueError, match="head"):
        sequential_groups({"params": {"conv_0": {}}})
    with pytest.raises(ValueError, match="4-D|\\(b, h, w, c\\)"):
        CNN((2,), (), 3).init(jax.random.key(0), jnp.zeros((1, 8, 8)))


def test_masking_conv_channels_equals_deleting_them():
    model, params, x = _model()
    groups = sequential_groups(params)
    masks = init_masks(params, groups)
    keep = {"conv_0": [0, 2], "conv_1": [1, 3], "dense_0": [0, 1, 2, 4]}
    for k, idx in keep.items():
        masks[k] = jnp.zeros_like(masks[k]).at[jnp.array(idx)].set(1.0)
    got = model.apply(analysis.apply_masks(params, masks, groups), x)

    # The smaller network with those channels / units deleted (NHWC flatten: row = s·C1 + c).
    p = jax.tree.map(np.asarray, params)["params"]
    k0, k1, k2 = (np.array(keep[k]) for k in ("conv_0", "conv_1", "dense_0"))
    d0 = p["dense_0"]["kernel"].reshape(-1, C1, H)[:, k1][..., k2].reshape(-1, len(k2))
    small = {
        "params": {
            "conv_0": {"kernel": p["conv_0"]["kernel"][..., k0], "bias": p["conv_0"]["bias"][k0]},
            "conv_1": {
                "kernel": p["conv_1"]["kernel"][:, :, k0][..., k1],
                "bias": p["conv_1"]["bias"][k1],
            },
            "dense_0": {"kernel": d0, "bias": p["dense_0"]["bias"][k2]},
            "head": {"kernel": p["head"]["kernel"][k2], "bias": p["head"]["bias"]},
        }
    }
    want = CNN((len(k0), len(k1)), (len(k2),), K).apply(small, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # The channel-dropped model really differs from the dense one.
    assert np.abs(np.asarray(model.apply(params, x)) - np.asarray(want)).max() > 1e-3


def test_l1_and_taylor_channel_scores_float64():
    model, params, x = _model()
    groups = sequential_groups(params)
    y, g = _grad()
    p, g = _f64(params), _f64(g)

    def reference(w):  # w: float64 leaves; |.| summed over each unit's group, written out
        rows = np.arange(p["dense_0"]["kernel"].shape[0])
        return {
            "conv_0": np.array(
                [w("conv_0")[..., c].sum() + w("conv_1")[:, :, c, :].sum() for c in range(C0)]
            ),
            "conv_1": np.array(
                [w("conv_1")[..., c].sum() + w("dense_0")[rows % C1 == c].sum() for c in range(C1)]
            ),
            "dense_0": w("dense_0").sum(0) + w("head").sum(1),
        }

    l1 = analysis.score_l1(params, groups)
    want = reference(lambda k: np.abs(p[k]["kernel"]))
    taylor = _score_taylor(model.apply, params, x, y, groups)
    want_t = reference(lambda k: np.abs(p[k]["kernel"] * g[k]["kernel"]))
    for k in want:
        np.testing.assert_allclose(np.asarray(l1[k]), want[k], rtol=1e-5)
        np.testing.assert_allclose(np.asarray(taylor[k]), want_t[k], rtol=1e-4, atol=1e-9)


def zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _group_vectors(params, groups, layer, c):
    """``(u_out, u_in)``: the parameters of unit ``c`` of ``layer`` (zero elsewhere)."""
    masks = init_masks(params, groups)
    masks[layer] = masks[layer].at[c].set(0.0)
    u = jax.tree.map(lambda a, b: a - b, params, analysis.apply_masks(params, masks, groups))
    nxt = {g.layer: g.next for g in groups}[layer]

    def only(keep):
        return {"params": {k: v if k == keep else zeros(v) for k, v in u["params"].items()}}

    return only(layer), only(nxt)


def _dot(a, b):
    return sum(
        float(np.sum(np.asarray(s, np.float64) * np.asarray(t, np.float64)))
        for s, t in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_jacobian_and_exact_tpv_channel_scores_match_their_definitions():
    # Jacobian: (⟨g, u_out⟩)² + (⟨g, u_in⟩)²; exact TPV: mean_x ‖J(x) u_c‖², here by forward-mode
    # jvp along u_c = u_out + u_in instead of reverse-mode per-example Jacobians.
    model, params, x = _model()
    groups = sequential_groups(params)
    y, g = _grad()
    jac = _score_jac(model.apply, params, x[None], y[None], groups)
    tpv = _score_tpv(model.apply, params, x, groups, chunk=4)
    jvp = jax.jit(lambda u: jax.jvp(lambda q: model.apply(q, x), (params,), (u,))[1])
    for layer, units in (("conv_0", C0), ("conv_1", C1), ("dense_0", H)):
        want_j, want_t = [], []
        for c in range(units):
            u_out, u_in = _group_vectors(params, groups, layer, c)
            want_j.append(_dot(g, u_out) ** 2 + _dot(g, u_in) ** 2)
            u = jax.tree.map(jnp.add, u_out, u_in)
            ju = jvp(u)
            want_t.append(np.mean(np.sum(np.asarray(ju, np.float64) ** 2, 1)))
        np.testing.assert_allclose(np.asarray(jac[layer]), want_j, rtol=1e-3, atol=1e-10)
        np.testing.assert_allclose(np.asarray(tpv[layer]), want_t, rtol=1e-4, atol=1e-9)


def test_prune_iteratively_over_channels_and_units():
    _, params, _ = _model()
    groups = sequential_groups(params)
    hist = analysis.prune_iteratively(
        params, groups, lambda q, m, s: analysis.score_l1(q, groups), target_ratio=0.5, steps=2
    )
    counts = [sum(int((1 - m[k]).sum()) for k in m) for m in hist]
    assert counts == [3, 6]  # 12 units in all
    assert all(int(hist[-1][k].sum()) >= 1 for k in hist[-1])


def test_bad_next_layer_is_rejected():
    _, params, _ = _model()
    groups = (PruneGroup("conv_0", "dense_0"),)  # dense_0 reads conv_1's 4 channels
    masks = {"conv_0": jnp.ones(C0)}
    with pytest.raises(ValueError, match="cannot read 3 units"):
        analysis.apply_masks(params, masks, groups)
