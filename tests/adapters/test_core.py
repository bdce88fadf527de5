"""Target rules, init, fold/unfold, initialisers and their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters as A
from tests.adapters.models import Block, perturb

X = jnp.linspace(-1.0, 1.0, 24).reshape(3, 8)


@pytest.fixture(scope="module")
def block():
    model = Block()
    return model, model.init(jax.random.key(0), X)


RULES = [
    (r".*fc1/kernel", A.lora(4, alpha=8.0)),
    (r".*qkv/kernel", A.lora(2, in_ndim=1)),
    (r".*out/kernel", A.lora(2, out_ndim=1)),
]


def test_init_holds_only_factors(block):
    _, variables = block
    ad = A.init(jax.random.key(1), variables, RULES)
    assert sorted(ad) == ["params/fc1/kernel", "params/out/kernel", "params/qkv/kernel"]
    shapes = {p: jax.tree.map(jnp.shape, a.factors) for p, a in ad.items()}
    assert shapes["params/fc1/kernel"] == {"a": (8, 4), "b": (4, 16)}
    assert shapes["params/qkv/kernel"] == {"a": (16, 2), "b": (2, 8)}
    assert shapes["params/out/kernel"] == {"a": (8, 2), "b": (2, 5)}
    # O(r (n + m)) trainable scalars, the kernels themselves are not in the tree.
    assert A.count_params(ad) == 4 * (8 + 16) + 2 * (16 + 8) + 2 * (8 + 5)


def test_first_rule_wins_and_none_freezes(block):
    _, variables = block
    rules = [(r".*fc1/kernel", None), (r".*kernel", A.lora(2, in_ndim=1))]
    ad = A.init(jax.random.key(1), variables, rules)
    assert "params/fc1/kernel" not in ad and "params/qkv/kernel" in ad


def test_zero_init_is_base_model(block):
    model, variables = block
    ad = A.init(jax.random.key(1), variables, RULES)
    np.testing.assert_allclose(
        A.adapt(model.apply)(variables, ad, X), model.apply(variables, X), atol=1e-6
    )


def test_unmerge_inverts_merge(block):
    _, variables = block
    ad = perturb(A.init(jax.random.key(1), variables, RULES))
    back = A.unfold(A.fold(variables, ad), ad)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(variables), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_merge_formula(block):
    _, variables = block
    ad = perturb(A.init(jax.random.key(1), variables, RULES))
    folded = A.fold(variables, ad)
    f = ad["params/fc1/kernel"]
    want = np.asarray(variables["params"]["fc1"]["kernel"], np.float64) + 2.0 * (
        np.asarray(f.factors["a"], np.float64) @ np.asarray(f.factors["b"], np.float64)
    )
    np.testing.assert_allclose(folded["params"]["fc1"]["kernel"], want, atol=1e-6)


@pytest.mark.parametrize(
    "spec,scale",
    [(A.lora(4), 1.0), (A.lora(4, alpha=16.0), 4.0), (A.lora(4, alpha=16.0, rslora=True), 8.0)],
)
def test_scaling(spec, scale):
    assert spec.scale == pytest.approx(scale)


def test_kaiming_and_gaussian_init_statistics():
    w = jnp.zeros((400, 300))
    a = A.init(jax.random.key(0), {"w": w}, [("w", A.lora(50))])["w"].factors
    assert float(jnp.abs(a["a"]).max()) <= 1 / np.sqrt(400)
    assert float(jnp.std(a["a"])) == pytest.approx(1 / np.sqrt(3 * 400), rel=0.05)
    assert not np.any(np.asarray(a["b"]))
    g = A.init(jax.random.key(0), {"w": w}, [("w", A.lora(50, init="gaussian"))])["w"].factors
    assert float(jnp.std(g["a"])) == pytest.approx(1 / 50, rel=0.05)


def test_pissa_is_principal_part_and_unmerge_keeps_function():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(12, 9))
    params = {"w": jnp.asarray(w, jnp.float32)}
    ad = A.init(jax.random.key(0), params, [("w", A.lora(3, alpha=6.0, init="pissa"))])
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    np.testing.assert_allclose(A.delta(ad["w"], (12, 9)), (u[:, :3] * s[:3]) @ vt[:3], atol=1e-5)
    residual = A.unfold(params, ad)
    np.testing.assert_allclose(A.fold(residual, ad)["w"], w, atol=1e-5)
    # The residual holds the remaining spectrum.
    np.testing.assert_allclose(np.linalg.svd(residual["w"], compute_uv=False)[:6], s[3:], atol=1e-4)


def test_stacked_init_is_per_layer():
    params = {"w": jnp.ones((3, 6, 4))}
    ad = A.init(jax.random.key(0), params, [("w", A.lora(2, in_ndim=1, out_ndim=1))])
    a = ad["w"].factors["a"]
    assert a.shape == (3, 6, 2) and not np.allclose(a[0], a[1])


def test_named_sets_add_up(block):
    model, variables = block
    ad1 = perturb(A.init(jax.random.key(1), variables, RULES), 0.1)
    ad2 = perturb(A.init(jax.random.key(2), variables, RULES[:1]), -0.2)
    got = A.adapt(model.apply)(variables, {"task1": ad1, "task2": ad2}, X)
    want = model.apply(A.fold(A.fold(variables, ad1), ad2), X)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_split_trainable_round_trip(block):
    _, variables = block
    train, frozen = A.split_trainable(variables, [r".*out/.*"])
    assert frozen["params"]["out"]["kernel"] is None and train["params"]["fc1"]["kernel"] is None
    assert jax.tree.all(jax.tree.map(jnp.array_equal, A.combine(train, frozen), variables))


# Errors that say what to do.


def test_no_match_lists_paths(block):
    _, variables = block
    with pytest.raises(ValueError, match=r"match no parameter(.|\n)*params/fc1/kernel"):
        A.init(jax.random.key(0), variables, [(r"attention/query", A.lora(2))])


def test_rank_too_large(block):
    _, variables = block
    with pytest.raises(ValueError, match=r"rank=9.*exceeds min\(n, m\) = 8"):
        A.init(jax.random.key(0), variables, [(r".*fc1/kernel", A.lora(9))])


def test_ambiguous_layout(block):
    _, variables = block
    with pytest.raises(ValueError, match="in_ndim"):
        A.init(jax.random.key(0), variables, [(r".*qkv/kernel", A.lora(2))])


def test_bias_is_not_a_matrix(block):
    _, variables = block
    with pytest.raises(ValueError, match="not a matrix"):
        A.init(jax.random.key(0), variables, [(r".*fc1/bias", A.lora(2))])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rank": 0}, "positive int"),
        ({"rank": 2, "dropout": 1.0}, "dropout"),
        ({"rank": 2, "init": "svd"}, "init"),
        ({"rank": 2, "alpha": -1.0}, "alpha"),
    ],
)
def test_bad_spec(kwargs, match):
    with pytest.raises(ValueError, match=match):
        A.lora(**kwargs)


def test_rules_must_be_pairs():
    with pytest.raises(TypeError, match="list of"):
        A.init(jax.random.key(0), {"w": jnp.ones((2, 2))}, ("w", A.lora(1)))


def test_integer_kernel_rejected():
    with pytest.raises(TypeError, match="floating"):
        A.init(jax.random.key(0), {"w": jnp.ones((4, 4), jnp.int32)}, [("w", A.lora(1))])
