"""GIST / LESS selection: per-example factor gradients, chunking, JL, GIST identities, scores."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters, models, selection
from lowrank_jax.selection.gradients import (
    adam_moments,
    adam_precondition,
    adam_update_direction,
    flatten_per_example,
    per_example_grads,
)
from lowrank_jax.selection.pipeline import WarmupCheckpoint
from lowrank_jax.selection.random_projection import jl_matrix, jl_project
from lowrank_jax.selection.scoring import cosine_scores, gist_basis, gist_scores, less_scores


def _lora_mlp(dtype=jnp.float32):
    model = models.MLP((8, 8), 3)
    x = jax.random.normal(jax.random.key(0), (12, 5), dtype)
    y = jnp.arange(12) % 3
    variables = jax.tree.map(lambda a: a.astype(dtype), model.init(jax.random.key(1), x[:1]))
    ad = adapters.init(jax.random.key(2), variables, [(r".*kernel", adapters.lora(2))])
    # Non-zero B so both factors get a gradient.
    ad = jax.tree.map(lambda a: a + 0.3 * jnp.ones_like(a), ad)
    fwd = adapters.adapt(model.apply)

    def loss(ad, variables, ex):
        logits = fwd(variables, ad, ex["x"][None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ex["y"][None])[0]

    return loss, ad, variables, {"x": x, "y": y}


def test_per_example_grads_equal_a_loop_of_single_grads_float64():
    with jax.enable_x64(True):
        loss, ad, variables, ex = _lora_mlp(jnp.float64)
        got = per_example_grads(loss, ad, variables, ex, chunk_size=5)
        grad_one = jax.jit(jax.grad(loss))
        for i in range(12):
            one = grad_one(ad, variables, jax.tree.map(lambda a, i=i: a[i], ex))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
                np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-12, atol=1e-14)
        # Gradients are of the factors A (n, r) and B (r, m), never of a full-size ΔW.
        shapes = {a.shape[1:] for a in jax.tree.leaves(got)}
        assert shapes == {(5, 2), (2, 8), (8, 2), (2, 3)}


def test_chunked_equals_unchunked_and_features_match_flat_grads():
    loss, ad, variables, ex = _lora_mlp()
    full = per_example_grads(loss, ad, variables, ex)
    for c in (5,):
        part = per_example_grads(loss, ad, variables, ex, chunk_size=c)
        for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(part), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    flat = flatten_per_example(full)
    r = jax.random.normal(jax.random.key(3), (flat.shape[1], 4))
    feats = selection.gradient_features(
        loss, ad, variables, ex, transform=jnp.matmul, transform_args=(r,), chunk_size=5
    )
    np.testing.assert_allclose(feats, flat @ r, rtol=1e-5, atol=1e-6)
    # jax.flatten_util order agrees with one example's ravel.
    one = jax.tree.map(lambda a: a[3], full)
    np.testing.assert_allclose(jax.flatten_util.ravel_pytree(one)[0], flat[3], rtol=0, atol=0)


def test_jl_projection_blockwise_equals_matrix_and_preserves_inner_products():
    x = jax.random.normal(jax.random.key(0), (6, 1000))
    key = jax.random.key(7)
    r = jl_matrix(1000, key=key, dim=512, block_size=300)
    np.testing.assert_allclose(
        jl_project(x, key=key, dim=512, block_size=300), x @ r, rtol=1e-4, atol=1e-4
    )
    # JL: |<xR, yR> - <x, y>| <= eps ||x|| ||y|| with eps = 6/sqrt(d) (a 6-sigma band per pair).
    for d in (512, 8192):
        px = jl_project(x, key=key, dim=d, block_size=256)
        g, gp = np.asarray(x @ x.T), np.asarray(px @ px.T)
        norms = np.sqrt(np.outer(np.diag(g), np.diag(g)))
        assert np.max(np.abs(gp - g) / norms) < 6 / np.sqrt(d)
    # Unbiased: averaged over 200 keys the inner product converges (sd of the mean ~ 1/sqrt(200 d)).
    keys = jax.random.split(jax.random.key(1), 200)
    ips = jax.vmap(lambda k: (lambda p: p[0] @ p[1])(jl_project(x[:2], key=k, dim=64)))(keys)
    ref = float(x[0] @ x[1])
    scale = float(jnp.linalg.norm(x[0]) * jnp.linalg.norm(x[1]))
    assert abs(float(ips.mean()) - ref) < 5 * scale / np.sqrt(200 * 64)


def test_gist_basis_is_the_top_right_singular_subspace_and_an_isometry_float64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        g = rng.normal(size=(9, 40)) @ np.diag(np.linspace(3, 0.1, 40))
        basis = gist_basis(jnp.asarray(g), k=4)
        _, s, vt = np.linalg.svd(g, full_matrices=False)
        p = np.asarray(basis.projection)
        np.testing.assert_allclose(p.T @ p, np.eye(4), atol=1e-10)
        np.testing.assert_allclose(np.asarray(basis.singular_values), s[:4], rtol=1e-10)
        np.testing.assert_allclose(np.abs(p.T @ vt[:4].T), np.eye(4), atol=1e-8)  # up to sign
        np.testing.assert_allclose(np.asarray(basis.val_features), g @ p, atol=1e-10)
        # k = rank(G): the projection keeps every inner product with a validation gradient.
        full = gist_basis(jnp.asarray(g), k=9)
        train = rng.normal(size=(30, 40))
        np.testing.assert_allclose(
            (train @ np.asarray(full.projection)) @ np.asarray(full.val_features).T,
            train @ g.T,
            rtol=1e-9,
            atol=1e-9,
        )
        # ... so for training gradients inside span(G), GIST's cosine (one subtask) is the raw cosine.
        inside = rng.normal(size=(30, 9)) @ g
        gist = gist_scores(
            (inside @ np.asarray(full.projection))[None],
            np.asarray(full.val_features)[None],
            np.zeros(9, np.int32),
            num_subtasks=1,
        )
        raw = cosine_scores(jnp.asarray(inside), jnp.asarray(g))
        np.testing.assert_allclose(gist, raw, rtol=1e-9, atol=1e-12)
        # Rank-deficient G: k beyond the rank gives zero columns, not NaN.
        low = gist_basis(jnp.asarray(g[:2].repeat(2, 0)), k=4)
        assert np.isfinite(np.asarray(low.projection)).all()
        np.testing.assert_allclose(np.asarray(low.projection)[:, 2:], 0.0)


def _ref_less(train, val, sub, t, w):
    w = np.asarray(w, float) / np.sum(w)
    n = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    per = sum(w[c] * n(train[c]) @ n(val[c]).T for c in range(len(w)))
    return np.stack([per[:, sub == s].mean(1) for s in range(t)], 1).max(1)


def _ref_gist(train, val, sub, t, w):
    w = np.asarray(w, float) / np.sum(w)
    n = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    cos = sum(
        w[c] * n(train[c]) @ n(np.stack([val[c][sub == s].mean(0) for s in range(t)])).T
        for c in range(len(w))
    )
    return cos.max(1)


def test_less_and_gist_scores_match_their_definitions():
    rng = np.random.default_rng(1)
    train, val = rng.normal(size=(3, 20, 7)), rng.normal(size=(3, 12, 7))
    sub = np.repeat(np.arange(4), 3)
    w = [1.0, 0.5, 0.25]
    for fn, ref in ((less_scores, _ref_less), (gist_scores, _ref_gist)):
        got = fn(jnp.asarray(train), jnp.asarray(val), sub, num_subtasks=4, weights=w)
        np.testing.assert_allclose(got, ref(train, val, sub, 4, w), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one per checkpoint"):
        less_scores(jnp.asarray(train), jnp.asarray(val), sub, num_subtasks=4, weights=[1.0])
    with pytest.raises(ValueError, match="every subtask"):
        gist_scores(jnp.asarray(train), jnp.asarray(val), sub, num_subtasks=5)


def test_adam_direction_matches_less_formula_and_moments_are_found():
    g = np.array([[1.0, -2.0], [0.5, 0.0]], np.float32)
    mu, nu = np.array([0.1, 0.2], np.float32), np.array([0.01, 0.04], np.float32)
    want = (0.9 * mu + 0.1 * g) / np.sqrt(0.999 * nu + 0.001 * g**2 + 1e-8)
    np.testing.assert_allclose(adam_update_direction(g, mu, nu), want, rtol=1e-6)
    np.testing.assert_allclose(adam_precondition(g, nu), g / (np.sqrt(nu) + 1e-8), rtol=1e-6)
    params = {"w": jnp.ones(3)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = tx.init(params)
    _, state = tx.update({"w": jnp.array([1.0, 2.0, 3.0])}, state, params)
    mu, nu, count = adam_moments(state)
    np.testing.assert_allclose(
        nu["w"], 0.001 * (np.array([1.0, 2.0, 3.0]) / np.sqrt(14)) ** 2, rtol=1e-5
    )
    assert int(count) == 1
    with pytest.raises(ValueError, match="ScaleByAdamState"):
        adam_moments(optax.sgd(0.1).init(params))


def test_select_top_random_cosine_and_storage_bytes():
    scores = jnp.array([0.1, 0.9, 0.5, 0.9, -1.0])
    np.testing.assert_array_equal(selection.select_top(scores, fraction=0.4), [1, 3])
    assert len(selection.select_top(scores, fraction=0.05)) == 1
    r = selection.random_scores(jax.random.key(0), 1000)
    assert 0.45 < float(r.mean()) < 0.55 and len(np.unique(np.asarray(r))) == 1000
    t, v = jnp.array([[1.0, 0.0], [1.0, 1.0]]), jnp.array([[2.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(cosine_scores(t, v), [1.0, 1 / np.sqrt(2)], rtol=1e-6)
    # LESS: d = 8192 float32 features at 4 checkpoints; GIST k = 9 at one.
    less = selection.feature_storage_bytes(dim=8192, num_checkpoints=4)
    gist = selection.feature_storage_bytes(dim=9, num_checkpoints=1)
    assert (less, gist) == (131072, 36)
    assert selection.feature_storage_bytes(dim=9, dtype=jnp.bfloat16) == 18
    with pytest.raises(ValueError, match="fraction"):
        selection.select_top(scores, fraction=0.0)
    with pytest.raises(ValueError, match="k must be"):
        gist_basis(jnp.ones((3, 5)), k=4)


def test_synthetic_pool_proportions_and_subtasks():
    p = selection.make_synthetic_pool(0, num_pool=1000, num_test=50, num_pretrain=40)
    counts = np.bincount(p.pool_kind, minlength=3)
    np.testing.assert_array_equal(counts, [150, 100, 750])
    assert p.pool_x.shape == (1000, 32) and p.val_x.shape == (45, 32)
    np.testing.assert_array_equal(np.bincount(p.val_subtask), [5] * 9)
    again = selection.make_synthetic_pool(0, num_pool=1000, num_test=50, num_pretrain=40)
    np.testing.assert_array_equal(p.pool_y, again.pool_y)


def test_pipelines_match_their_pieces():
    loss, ad, variables, ex = _lora_mlp()
    val, sub = jax.tree.map(lambda a: a[:6], ex), np.array([0, 0, 0, 1, 1, 1])
    flat = lambda e: flatten_per_example(  # noqa: E731
        per_example_grads(loss, ad, variables, e)
    )
    g_pool, g_val = flat(ex), flat(val)
    # GIST: k = 2 from the k = 4 pass equals a k = 2 basis.
    got = selection.gist_pipeline(loss, ad, variables, ex, val, sub, num_subtasks=2, ks=(2, 4))
    b2 = gist_basis(g_val, k=2)
    want = gist_scores((g_pool @ b2.projection)[None], b2.val_features[None], sub, num_subtasks=2)
    np.testing.assert_allclose(got[2], want, rtol=1e-4, atol=1e-5)
    # GIST-diag: GIST on Adam-scaled gradients.
    nu = jnp.linspace(0.1, 2.0, g_pool.shape[1])
    diag = selection.gist_pipeline(
        loss, ad, variables, ex, val, sub, num_subtasks=2, ks=(3,), nu=nu
    )
    b3 = gist_basis(adam_precondition(g_val, nu), k=3)
    want = gist_scores(
        (adam_precondition(g_pool, nu) @ b3.projection)[None],
        b3.val_features[None],
        sub,
        num_subtasks=2,
    )
    np.testing.assert_allclose(diag[3], want, rtol=1e-4, atol=1e-5)
    # LESS with one checkpoint: Adam direction of the pool, JL of both, less_scores.
    mu = jnp.full(g_pool.shape[1], 0.01)
    ck = WarmupCheckpoint(ad, mu, nu, 1.0)
    key = jax.random.key(4)
    got = selection.less_pipeline(
        loss, [ck], variables, ex, val, sub, num_subtasks=2, key=key, dim=16, chunk_size=5
    )
    tr = jl_project(adam_update_direction(g_pool, mu, nu), key=key, dim=16)
    va = jl_project(g_val, key=key, dim=16)
    want = less_scores(tr[None], va[None], sub, num_subtasks=2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    cos = selection.cosine_pipeline(loss, ad, variables, ex, val, chunk_size=5)
    np.testing.assert_allclose(cos, cosine_scores(g_pool, g_val), rtol=1e-5, atol=1e-6)


def test_warmup_optimizer_is_adamw_on_less_linear_schedule():
    tx, schedule = selection.warmup_optimizer(2e-3, num_steps=100)
    rates = np.asarray([schedule(i) for i in range(101)])
    # 3 steps up from 0 to the peak, then linearly down to 0 at step 100.
    np.testing.assert_allclose(rates[[0, 1, 3, 50, 100]], [0, 2e-3 / 3, 2e-3, 2e-3 * 50 / 97, 0], rtol=1e-6, atol=1e-9)  # fmt: skip
    assert rates.argmax() == 3 and np.all(np.diff(rates[3:]) < 0)
    # The transformation is AdamW (no weight decay) on that schedule.
    ref = optax.adamw(schedule, weight_decay=0.0)
    params = {"w": jnp.arange(4.0)}
    s, r = tx.init(params), ref.init(params)
    for i in range(5):
        g = {"w": jnp.sin(jnp.arange(4.0) + i)}
        u, s = tx.update(g, s, params)
        v, r = ref.update(g, r, params)
        np.testing.assert_allclose(u["w"], v["w"], rtol=1e-6, atol=1e-12)
    _, short = selection.warmup_optimizer(1.0, num_steps=10)  # round(0.3) = 0: one step up
    assert float(short(1)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="num_steps=0 is invalid"):
        selection.warmup_optimizer(1e-3, num_steps=0)
    with pytest.raises(ValueError, match="learning_rate=0.0 is invalid"):
        selection.warmup_optimizer(0.0, num_steps=10)
