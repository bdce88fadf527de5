"""DoRA: forward against a float64 reference, the detached norm's gradients, the factorised norm,
fold/unfold, stacked kernels, and a training step that lowers for TPU and GPU."""

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import lowering
from lowrank_jax import adapters as A
from lowrank_jax.adapters.dora import dora_column_norms
from lowrank_jax.adapters.kinds import dropout
from tests.adapters.models import Scanned, perturb

N, M, R = 12, 7, 3
PARAMS = {"fc": {"kernel": jax.random.normal(jax.random.key(0), (N, M))}}
X = jax.random.normal(jax.random.key(1), (5, N))
RULES = [(r"fc/kernel", A.dora(R, alpha=6.0))]


def f(p, x):
    return x @ p["fc"]["kernel"]


def _trained():
    return perturb(A.init(jax.random.key(2), PARAMS, RULES), 0.1)


def _reference(ad, w=PARAMS["fc"]["kernel"]):
    """float64 ``(W + s·A B)·diag(mag / ‖W + s·A B‖_col)``."""
    a, b, mag = (np.asarray(ad.factors[k], np.float64) for k in ("a", "b", "m"))
    v = np.asarray(w, np.float64) + ad.kind.scale * a @ b
    return v * (mag / np.linalg.norm(v, axis=0))


def test_init_starts_at_the_base_model_with_peft_magnitudes():
    ad = A.init(jax.random.key(2), PARAMS, RULES)["fc/kernel"]
    np.testing.assert_allclose(
        ad.factors["m"], np.linalg.norm(np.asarray(PARAMS["fc"]["kernel"]), axis=0), rtol=1e-6
    )
    np.testing.assert_allclose(
        jax.jit(A.adapt(f))(PARAMS, {"fc/kernel": ad}, X), f(PARAMS, X), rtol=1e-5, atol=1e-6
    )


def test_forward_transposed_and_merge_match_the_float64_reference():
    ad = _trained()
    w_prime = _reference(ad["fc/kernel"])
    np.testing.assert_allclose(
        jax.jit(A.adapt(f))(PARAMS, ad, X), np.asarray(X) @ w_prime, atol=1e-5
    )
    y = jax.random.normal(jax.random.key(3), (4, M))
    tied = A.adapt(lambda p, y: y @ p["fc"]["kernel"].T)(PARAMS, ad, y)
    np.testing.assert_allclose(tied, np.asarray(y) @ w_prime.T, atol=1e-5)
    np.testing.assert_allclose(A.fold(PARAMS, ad)["fc"]["kernel"], w_prime, atol=1e-5)


def test_factorised_column_norms_match_numpy():
    a = jax.random.normal(jax.random.key(4), (N, R))
    b = jax.random.normal(jax.random.key(5), (R, M))
    w = PARAMS["fc"]["kernel"]
    want = np.linalg.norm(np.asarray(w, np.float64) + 0.7 * np.asarray(a) @ np.asarray(b), axis=0)
    np.testing.assert_allclose(dora_column_norms(w, a, b, scale=0.7), want, rtol=1e-5)


def test_gradients_treat_the_norm_as_a_constant_as_peft_does():
    ad = _trained()
    target = jax.random.normal(jax.random.key(6), (5, M))

    def dense(ad, detach):
        a, b, mag = (ad["fc/kernel"].factors[k] for k in ("a", "b", "m"))
        v = PARAMS["fc"]["kernel"] + ad["fc/kernel"].kind.scale * a @ b
        norm = jnp.linalg.norm(v, axis=0)
        return X @ (v * mag / (jax.lax.stop_gradient(norm) if detach else norm))

    loss = lambda out: jnp.sum((out - target) ** 2)
    ours = jax.jit(jax.grad(lambda ad: loss(A.adapt(f)(PARAMS, ad, X))))(ad)
    want = jax.grad(lambda ad: loss(dense(ad, True)))(ad)
    full = jax.grad(lambda ad: loss(dense(ad, False)))(ad)
    for k in ("a", "b", "m"):
        got, ref = ours["fc/kernel"].factors[k], want["fc/kernel"].factors[k]
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    # The detached gradient is a different one (so the check above could fail).
    assert not np.allclose(
        ours["fc/kernel"].factors["b"], full["fc/kernel"].factors["b"], atol=1e-3
    )


def test_the_training_step_forms_no_n_by_m_product():
    ad = _trained()
    grad = jax.grad(lambda ad: jnp.sum(A.adapt(f)(PARAMS, ad, X) ** 2))
    jaxpr = jax.make_jaxpr(grad)(ad)

    def products(jaxpr):
        for eqn in jaxpr.eqns:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from products(sub)
            if eqn.primitive.name == "dot_general":
                yield eqn.outvars[0].aval.shape

    shapes = list(products(jaxpr.jaxpr))
    assert shapes and (N, M) not in shapes and (M, N) not in shapes, shapes


def test_unmerge_needs_the_norms_taken_before_merging():
    ad = _trained()
    folded = A.fold(PARAMS, ad)
    with pytest.raises(ValueError, match="unfold_dora"):
        A.unfold(folded, ad)
    with pytest.raises(ValueError, match="no norms for the DoRA kernels"):
        A.unfold_dora(folded, ad, {})
    back = A.unfold_dora(folded, ad, A.dora_norms(PARAMS, ad))
    np.testing.assert_allclose(back["fc"]["kernel"], PARAMS["fc"]["kernel"], atol=1e-5)


def test_stacked_kernels_under_scan_and_remat():
    x = jax.random.normal(jax.random.key(7), (4, 5))
    variables = Scanned().init(jax.random.key(8), x)
    rules = [(r".*layers/dense/kernel", A.dora(2, in_ndim=1, out_ndim=1))]
    ad = perturb(A.init(jax.random.key(9), variables, rules), 0.1)
    assert ad["params/layers/dense/kernel"].factors["m"].shape == (3, 6)
    ours = jax.jit(A.adapt(Scanned().apply))(variables, ad, x)
    folded = A.fold(variables, ad)
    np.testing.assert_allclose(ours, Scanned().apply(folded, x), atol=1e-5)
    back = A.unfold_dora(folded, ad, A.dora_norms(variables, ad))
    np.testing.assert_allclose(
        back["params"]["layers"]["dense"]["kernel"],
        variables["params"]["layers"]["dense"]["kernel"],
        atol=1e-5,
    )


def test_dropout_recomputes_the_base_product_on_the_dropped_input():
    spec = A.dora(R, alpha=6.0, dropout=0.5)
    factors, w = _trained()["fc/kernel"].factors, PARAMS["fc"]["kernel"]
    key = jax.random.key(10)
    got = spec.apply_delta(factors, X, key=key, kernel=w, base=X @ w)  # base is not reused
    x_d = dropout(X, key, 0.5)
    c = factors["m"] / dora_column_norms(w, factors["a"], factors["b"], scale=spec.scale)
    want = (c - 1) * (x_d @ w) + c * (spec.scale * (x_d @ factors["a"]) @ factors["b"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # whole=True returns x·W + the delta (adapt's path for a kernel with one DoRA adapter).
    for k in (key, None):
        whole = spec.apply_delta(factors, X, key=k, kernel=w, base=X @ w, whole=True)
        delta = spec.apply_delta(factors, X, key=k, kernel=w)
        np.testing.assert_allclose(whole, X @ w + delta, rtol=1e-5, atol=1e-5)
    ad = {"fc/kernel": _trained()["fc/kernel"].replace(kind=spec)}
    dropped = A.adapt(f)(PARAMS, ad, X, adapter_key=key)
    assert not np.allclose(dropped, A.adapt(f)(PARAMS, ad, X), atol=1e-3)


def test_dora_without_the_kernel_and_on_the_linen_backend_is_refused():
    ad = _trained()
    with pytest.raises(ValueError, match="DoRA needs the frozen kernel"):
        ad["fc/kernel"].kind.apply_delta(ad["fc/kernel"].factors, X)
    dense = nn.Dense(M)
    variables = dense.init(jax.random.key(0), X)
    ad = A.init(jax.random.key(1), variables, [(r".*kernel", A.dora(2))])
    with pytest.raises(ValueError, match="backend='quax'"):
        A.adapt(dense.apply, backend="linen")(variables, ad, X)


def test_a_dora_training_step_lowers_for_tpu_and_gpu():
    ad = _trained()
    step = jax.jit(jax.grad(lambda ad, x: jnp.sum(A.adapt(f)(PARAMS, ad, x) ** 2)))
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), ad)
    spec = lowering.Step("dora grad", step, (abstract, jax.ShapeDtypeStruct(X.shape, X.dtype)))
    assert lowering.check_exported(lowering.export_step(spec), spec) == []


def test_the_magnitude_is_sharded_like_the_kernel_outputs():
    from jax.sharding import PartitionSpec as P

    specs = A.partition_specs(_trained(), {"fc": {"kernel": P("data", "model")}})
    assert specs["fc/kernel"].factors == {
        "a": P("data", None),
        "b": P(None, "model"),
        "m": P("model"),
    }


@pytest.mark.parametrize("dora_first", [True, False])
def test_unmerge_dora_with_a_lora_on_the_same_kernel_in_either_order(dora_first):
    dora_set = _trained()
    lora_set = perturb(A.init(jax.random.key(5), PARAMS, [(r"fc/kernel", A.lora(2))]), 0.1)
    sets = [dora_set, lora_set] if dora_first else [lora_set, dora_set]
    norms = A.dora_norms(PARAMS, dora_set)
    back = A.unfold_dora(A.fold(PARAMS, sets), sets, norms)
    np.testing.assert_allclose(back["fc"]["kernel"], PARAMS["fc"]["kernel"], atol=1e-5)


def test_pissa_initialisation_and_merging_dora_sets_without_the_base_are_refused():
    with pytest.raises(ValueError, match="pissa"):
        A.dora(2, init="pissa")
    from lowrank_jax import merging

    with pytest.raises(ValueError, match="DoRA.*base="):
        merging.merge_task_arithmetic([_trained(), _trained()])
