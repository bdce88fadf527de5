"""Spectral (SBVI/AdaLoRA), FourierFT and VeRA kinds: factorised == materialised == float64 formula."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters as A
from lowrank_jax.adapters.fourierft import fourier_frequencies
from lowrank_jax.adapters.vera import vera_projections

N_IN, N_OUT = 12, 10
ATOL = 1e-5


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(N_OUT, name="fc2")(nn.relu(nn.Dense(N_IN, name="fc1")(x)))


def _check_kind(kind, factors, reference):
    """apply_delta, apply_delta_transposed and materialize against a float64 ΔW."""
    x = np.random.default_rng(1).standard_normal((4, N_IN)).astype(np.float32)
    y = np.random.default_rng(2).standard_normal((4, N_OUT)).astype(np.float32)
    shape = (N_IN, N_OUT)
    np.testing.assert_allclose(kind.materialize(factors, shape=shape), reference, atol=ATOL)
    fwd = jax.jit(functools.partial(kind.apply_delta, shape=shape))
    np.testing.assert_allclose(fwd(factors, x), x @ reference, atol=ATOL)
    bwd = jax.jit(functools.partial(kind.apply_delta_transposed, shape=shape))
    np.testing.assert_allclose(bwd(factors, y), y @ reference.T, atol=ATOL)
    assert all(hasattr(leaf, "shape") for leaf in jax.tree.leaves(factors))  # no shape markers


@pytest.mark.parametrize("init", ["stiefel", "adalora"])
def test_spectral_kind(init):
    kind = A.spectral(4, init=init, scale=0.5, sigma_init=0.3)
    f = kind.init_factors(jax.random.key(0), jnp.zeros((N_IN, N_OUT)))
    f = {**f, "s": jnp.asarray([1.0, 0.5, 0.25, 0.0])}
    u, s, v = (np.asarray(f[k], np.float64) for k in ("u", "s", "v"))
    _check_kind(kind, f, 0.5 * (u * s) @ v.T)
    if init == "stiefel":
        np.testing.assert_allclose(u.T @ u, np.eye(4), atol=1e-6)
        np.testing.assert_allclose(v.T @ v, np.eye(4), atol=1e-6)


def test_spectral_zero_sigma_is_base_model_and_merges():
    model = _MLP()
    x = jax.random.normal(jax.random.key(0), (3, 8))
    variables = model.init(jax.random.key(1), x)
    ad = A.init(jax.random.key(2), variables, [(r".*kernel", A.spectral(3))])
    fwd = jax.jit(A.adapt(model.apply))
    np.testing.assert_allclose(fwd(variables, ad, x), model.apply(variables, x), atol=1e-6)
    ad = jax.tree.map(lambda t: t + 0.1, ad)
    np.testing.assert_allclose(
        fwd(variables, ad, x), model.apply(A.fold(variables, ad), x), atol=ATOL
    )


def test_spectral_errors():
    with pytest.raises(ValueError, match="positive int"):
        A.spectral(0)
    with pytest.raises(ValueError, match="init"):
        A.spectral(2, init="svd")
    with pytest.raises(ValueError, match="exceeds min"):
        A.init(jax.random.key(0), {"k": jnp.zeros((3, 5))}, [("k", A.spectral(4))])


def test_fourierft_is_the_real_part_of_a_sparse_inverse_dft():
    kind = A.fourierft(25, scale=3.0)
    f = kind.init_factors(jax.random.key(0), jnp.zeros((N_IN, N_OUT)))
    k, ell = fourier_frequencies(N_IN, N_OUT, n_coeff=25)
    spec = np.zeros((N_IN, N_OUT), complex)
    spec[k, ell] = np.asarray(f["coeffs"], np.float64)
    a, b = np.arange(N_IN)[:, None], np.arange(N_OUT)[None, :]
    # ΔW[a, b] = (α/(nm)) Σ_j c_j cos(2π(a k_j/n + b l_j/m)), written out without an FFT.
    ref = (
        sum(
            c * np.cos(2 * np.pi * (a * kj / N_IN + b * lj / N_OUT))
            for c, kj, lj in zip(np.asarray(f["coeffs"], np.float64), k, ell, strict=True)
        )
        * 3.0
        / (N_IN * N_OUT)
    )
    np.testing.assert_allclose(ref, 3.0 * np.fft.ifft2(spec).real, atol=1e-12)
    _check_kind(kind, f, ref)
    assert len(set(zip(k, ell, strict=True))) == 25


def test_vera_formula_shared_projections_and_zero_start():
    kind = A.vera(6, d_initial=0.3)
    f = kind.init_factors(jax.random.key(0), jnp.zeros((N_IN, N_OUT)))
    assert set(f) == {"d", "b"}  # the matrix view comes from Adapter.matrix, not the factors
    np.testing.assert_allclose(kind.materialize(f, shape=(N_IN, N_OUT)), 0.0)  # b = 0: base model
    with pytest.raises(ValueError, match="matrix view"):
        kind.materialize(f, shape=None)
    f = {**f, "b": jnp.linspace(-1.0, 1.0, N_OUT)}
    a, b = vera_projections(N_IN, N_OUT, rank=6)
    assert a.shape == (6, N_IN) and b.shape == (N_OUT, 6)
    assert np.abs(a).max() <= math.sqrt(6 / N_IN) and np.abs(b).max() <= 1.0  # Kaiming bounds
    ref = (a.T * 0.3) @ b.T * np.linspace(-1.0, 1.0, N_OUT)
    _check_kind(kind, f, ref)
    np.testing.assert_array_equal(vera_projections(N_IN, N_OUT, rank=6)[0], a)  # shared per seed


@pytest.mark.parametrize(
    "spec", [A.fourierft(30), A.vera(4), A.frameft(30)], ids=["fourierft", "vera", "frameft"]
)
def test_baselines_through_adapt_and_merge(spec):
    model = _MLP()
    x = jax.random.normal(jax.random.key(0), (3, 8))
    variables = model.init(jax.random.key(1), x)
    ad = A.init(jax.random.key(2), variables, [(r".*fc1/kernel", spec)])
    ad = jax.tree.map(lambda t: t + 0.5, ad)
    fwd = jax.jit(A.adapt(model.apply))
    np.testing.assert_allclose(
        fwd(variables, ad, x), model.apply(A.fold(variables, ad), x), atol=ATOL
    )
