"""Tight fusion frames and the FrameFT adapter: orthogonality, FFT paths, factorised == folded."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters as A
from lowrank_jax import spectral
from lowrank_jax.adapters.frameft import frame_positions
from lowrank_jax.spectral.frames import (
    real_tight_fusion_frame,
    realify,
    spectral_tetris,
    tight_fusion_frame_exists,
)

ATOL = 1e-5  # float32 FFTs and matmuls of width <= 64


# --- frames ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dim", "l"), [(16, 2), (24, 4), (16, 8), (64, 8), (10, 2), (96, 6)])
def test_frame_basis_is_exactly_orthogonal(dim, l):  # noqa: E741
    phi = spectral.frame_basis(dim, l=l)
    assert phi.shape == (dim, dim) and phi.dtype == np.float64
    np.testing.assert_allclose(phi @ phi.T, np.eye(dim), atol=1e-12)
    np.testing.assert_allclose(phi.T @ phi, np.eye(dim), atol=1e-12)


def test_frame_basis_is_cached_read_only_and_sparser_for_larger_l():
    assert spectral.frame_basis(64, l=8) is spectral.frame_basis(64, l=8)
    assert not spectral.frame_basis(64, l=8).flags.writeable
    # L = 2 is a realified DFT of size N/2; larger L is block-diagonal with ~2/L non-zeros.
    assert spectral.frame_nnz(64, l=8) <= 2 * 64 // 8
    assert spectral.frame_nnz(64, l=8) < spectral.frame_nnz(64, l=2) <= 64


def test_frame_l2_is_a_realified_dft():
    n = 8
    phi = spectral.frame_basis(2 * n, l=2)
    dft = np.exp(2j * np.pi * np.outer(np.arange(n), np.arange(n)) / n) / math.sqrt(n)
    np.testing.assert_allclose(phi, realify(dft), atol=1e-12)


@pytest.mark.parametrize(("k", "l", "n"), [(5, 2, 7), (4, 3, 7), (6, 4, 10)])
def test_spectral_tetris_gives_a_tight_fusion_frame(k, l, n):  # noqa: E741
    t = spectral_tetris(l=l, n=n)
    np.testing.assert_allclose(t @ t.T, (n / l) * np.eye(l), atol=1e-12)
    np.testing.assert_allclose(np.sum(t**2, axis=0), np.ones(n), atol=1e-12)
    assert tight_fusion_frame_exists(k=k, l=l, n=n)
    f = spectral.tight_fusion_frame(k=k, l=l, n=n)  # (k, l, n)
    # Σ_k P_{W_k} = (k l / n) I: a tight fusion frame; the stack is Parseval.
    projectors = sum(
        np.linalg.pinv(fk) @ fk for fk in f
    )  # orthogonal projector onto the row space of each F_k
    np.testing.assert_allclose(projectors, (k * l / n) * np.eye(n), atol=1e-10)
    real = real_tight_fusion_frame(k=k, l=l, n=n).reshape(-1, 2 * n)
    np.testing.assert_allclose(real.T @ real, np.eye(2 * n), atol=1e-12)


def test_frame_errors_say_what_to_do():
    with pytest.raises(ValueError, match="even l that divides"):
        spectral.frame_basis(10, l=4)
    with pytest.raises(ValueError, match="k >= "):
        spectral.tight_fusion_frame(k=3, l=2, n=5)
    with pytest.raises(ValueError, match="basis must be one of"):
        spectral.frame_basis(8, basis="dct")
    assert not tight_fusion_frame_exists(k=3, l=2, n=5)


@pytest.mark.parametrize(("dim", "l"), [(16, 2), (24, 4), (64, 8)])
def test_fft_analysis_and_synthesis_match_the_basis(dim, l):  # noqa: E741
    x = np.random.default_rng(0).standard_normal((3, 2, dim))
    phi = spectral.frame_basis(dim, l=l)
    np.testing.assert_allclose(
        jax.jit(lambda v: spectral.frame_analysis(v, l=l))(x.astype(np.float32)),
        x @ phi.T,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        spectral.frame_synthesis(x.astype(np.float32), l=l), x @ phi, atol=1e-5
    )


# --- FrameFT ----------------------------------------------------------------------------------------


def _reference_delta(kind, coeffs, n, m):
    """float64 NumPy ΔW = (scale/√(nm)) Φ_inᵀ S Φ_out."""
    rows, cols = frame_positions(
        n, m, n_coeff=kind.n_coeff, seed=kind.entry_seed, num_blocks=kind.num_blocks
    )
    s = np.zeros((n, m))
    s[rows, cols] = np.asarray(coeffs, np.float64)
    p_in = spectral.frame_basis(n, l=kind.l, basis=kind.basis, seed=kind.basis_seed)
    l_out = kind.l if kind.l_out is None else kind.l_out
    p_out = spectral.frame_basis(m, l=l_out, basis=kind.basis, seed=kind.basis_seed)
    return p_in.T @ s @ p_out * kind.scale / math.sqrt(n * m)


KINDS = [
    A.frameft(40, l=2),
    A.frameft(40, l=4, l_out=8),
    A.frameft(40, basis="random", strategy="gather"),
    A.frameft(40, basis="random", strategy="dense"),
    A.frameft(40, basis="identity"),
    A.frameft(40, l=8, strategy="gather", num_blocks=2),
]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{k.basis}-l{k.l}-{k.strategy}")
def test_frameft_factorised_equals_materialised_equals_reference(kind):
    n, m = 24, 16
    kernel = jnp.zeros((n, m))
    f = kind.init_factors(jax.random.key(0), kernel)
    assert jax.tree.map(jnp.shape, f) == {"coeffs": (40,)}
    ref = _reference_delta(kind, f["coeffs"], n, m)
    np.testing.assert_allclose(kind.materialize(f, shape=(n, m)), ref, atol=ATOL)
    x = np.random.default_rng(1).standard_normal((5, n)).astype(np.float32)
    y = np.random.default_rng(2).standard_normal((5, m)).astype(np.float32)
    fwd = jax.jit(functools.partial(kind.apply_delta, shape=(n, m)))
    bwd = jax.jit(functools.partial(kind.apply_delta_transposed, shape=(n, m)))
    np.testing.assert_allclose(fwd(f, x), x @ ref, atol=ATOL)
    np.testing.assert_allclose(bwd(f, y), y @ ref.T, atol=ATOL)


def test_frameft_strategies_have_equal_gradients():
    n, m = 16, 24
    f = A.frameft(30, l=4).init_factors(jax.random.key(3), jnp.zeros((n, m)))
    x = jax.random.normal(jax.random.key(4), (6, n))

    def grad(strategy):
        kind = A.frameft(30, l=4, strategy=strategy)
        loss = lambda c: jnp.sum(kind.apply_delta({**f, "coeffs": c}, x, shape=(n, m)) ** 2)
        return jax.jit(jax.grad(loss))(f["coeffs"])

    ref = grad("dense")
    for s in ("fft", "gather"):
        np.testing.assert_allclose(grad(s), ref, rtol=1e-4, atol=1e-5)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="fc1")(x))
        return nn.Dense(8, name="fc2")(x)


def test_frameft_through_adapt_merge_and_unmerge():
    model = _MLP()
    x = jax.random.normal(jax.random.key(0), (4, 16))
    variables = model.init(jax.random.key(1), x)
    rules = [(r".*fc1/kernel", A.frameft(64, l=4)), (r".*fc2/kernel", A.frameft(20))]
    ad = A.init(jax.random.key(2), variables, rules)
    assert A.count_params(ad) == 64 + 20
    fwd = jax.jit(A.adapt(model.apply))
    np.testing.assert_allclose(
        fwd(variables, ad, x), model.apply(A.fold(variables, ad), x), atol=ATOL
    )
    back = A.unfold(A.fold(variables, ad), ad)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(variables), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    zero = A.init(jax.random.key(2), variables, [(r".*fc1/kernel", A.frameft(64, init_std=0.0))])
    np.testing.assert_allclose(fwd(variables, zero, x), model.apply(variables, x), atol=1e-6)
    g = jax.jit(jax.grad(lambda a: jnp.sum(fwd(variables, a, x) ** 2)))(ad)
    assert jax.tree.map(jnp.shape, g["params/fc1/kernel"].factors)["coeffs"] == (64,)


def test_frameft_shares_positions_and_bases_across_layers():
    kind = A.frameft(50, l=4)
    f1 = kind.init_factors(jax.random.key(0), jnp.zeros((16, 16)))
    f2 = kind.init_factors(jax.random.key(1), jnp.zeros((16, 16)))
    r1 = frame_positions(16, 16, n_coeff=50)
    r2 = frame_positions(16, 16, n_coeff=50)
    assert r1[0] is r2[0]  # one cached copy per shape
    assert len(set(zip(*r1, strict=True))) == 50  # distinct positions
    assert not np.allclose(f1["coeffs"], f2["coeffs"])


def test_frameft_flops_shrink_with_l():
    n = m = 64
    f2 = A.frameft(256, l=2).delta_flops(n, m)
    f8 = A.frameft(256, l=8).delta_flops(n, m)
    assert f8 < f2 / 2


def test_frameft_errors():
    with pytest.raises(ValueError, match="positive int"):
        A.frameft(0)
    with pytest.raises(ValueError, match="basis"):
        A.frameft(4, basis="dct")
    with pytest.raises(ValueError, match="needs basis='frame'"):
        A.frameft(4, basis="random", strategy="fft")
    variables = {"params": {"w": {"kernel": jnp.zeros((10, 6))}}}
    with pytest.raises(ValueError, match="exceeds the 60 positions"):
        A.init(jax.random.key(0), variables, [(r".*kernel", A.frameft(61))])
    with pytest.raises(ValueError, match="must be even and divide"):
        A.init(jax.random.key(0), variables, [(r".*kernel", A.frameft(8, l=4))])


# --- the shapes FrameFT actually uses (digits MLP 64/256 wide with L = 2, 8; MiniLM 384/1536, L = 2)


@pytest.mark.parametrize(("dim", "l"), [(256, 8), (384, 2), (1536, 2)])
def test_frame_basis_is_the_parseval_tight_fusion_frame_at_frameft_widths(dim, l):  # noqa: E741
    # FrameFT's "frame" basis is the realified tight fusion frame (K, l, n) = (N/L, L/2, N/2).
    k, sub, n = dim // l, l // 2, dim // 2
    f = spectral.tight_fusion_frame(k=k, l=sub, n=n)  # (K, l, n) complex128
    # Σ_k P_{row(F_k)} = (K l / n) I = I, with each projector F_kᴴ (F_k F_kᴴ)⁻¹ F_k in float64.
    # With W_k = (F_k F_kᴴ)^{-1/2} F_k, P_{row(F_k)} = W_kᴴ W_k, so Σ_k P = Wᴴ W of the stack.
    evals, evecs = np.linalg.eigh(np.einsum("kln,kmn->klm", f, f.conj()))
    inv_sqrt = np.einsum("klj,kj,kmj->klm", evecs, 1 / np.sqrt(evals), evecs.conj())
    w = np.einsum("klm,kmn->kln", inv_sqrt, f).reshape(k * sub, n)
    np.testing.assert_allclose(w.conj().T @ w, np.eye(n), atol=1e-10)
    # Parseval: each row space has dimension l and the stack is unitary.
    stack = f.reshape(k * sub, n)
    np.testing.assert_allclose(stack.conj().T @ stack, np.eye(n), atol=1e-10)
    # ... and it is exactly the basis the adapter uses (a bug in the row order (k, r, re/im)
    # or in the realification would keep Φ orthogonal but break this).
    real = real_tight_fusion_frame(k=k, l=sub, n=n).reshape(dim, dim)
    np.testing.assert_array_equal(spectral.frame_basis(dim, l=l), real)


@pytest.mark.parametrize(("dim", "l"), [(256, 8), (384, 2), (1536, 2)])
def test_fft_frame_transforms_match_float64_at_frameft_widths(dim, l):  # noqa: E741
    x = np.random.default_rng(dim).standard_normal((4, dim))
    phi = spectral.frame_basis(dim, l=l)
    ana = jax.jit(lambda v: spectral.frame_analysis(v, l=l))(x.astype(np.float32))
    syn = jax.jit(lambda v: spectral.frame_synthesis(v, l=l))(x.astype(np.float32))
    # float32 FFTs of length <= 768: relative error ~1e-6 · log N on O(1) outputs
    np.testing.assert_allclose(ana, x @ phi.T, atol=5e-5)
    np.testing.assert_allclose(syn, x @ phi, atol=5e-5)


def _hlo_shapes(fn, *args) -> set[tuple[int, ...]]:
    """Every array shape in the optimised HLO of ``jax.jit(fn)(*args)``."""
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    dims = re.findall(r"(?:f32|f64|c64|c128|s32|bf16|f16)\[([0-9,]*)\]", text)
    return {tuple(int(v) for v in d.split(",")) if d else () for d in dims}


def test_fft_path_never_materialises_an_n_by_m_array():
    # MiniLM's FFN kernel shape (384 -> 1536) with the FrameFT config's 921 coefficients, L = 2.
    n, m = 384, 1536
    x = jax.random.normal(jax.random.key(0), (8, n))
    y = jax.random.normal(jax.random.key(1), (8, m))

    def has_nm(shapes):  # an array with both an n- and an m-sized axis (ΔW or a slice of it)
        return any(n in s and m in s for s in shapes)

    def shapes(strategy, grad):
        kind = A.frameft(921, l=2, strategy=strategy)
        c = kind.init_factors(jax.random.key(2), jnp.zeros((n, m)))["coeffs"]
        fwd = lambda c, x: kind.apply_delta({"coeffs": c}, x, shape=(n, m))
        if not grad:
            return _hlo_shapes(fwd, c, x)
        # value and gradient of a loss of the forward and the transposed product (x, y are
        # arguments, not constants: XLA would constant-fold the dense path for minutes)
        bwd = lambda c, y: kind.apply_delta_transposed({"coeffs": c}, y, shape=(n, m))
        loss = lambda c, x, y: jnp.vdot(fwd(c, x), y) + jnp.sum(bwd(c, y) ** 2)
        return _hlo_shapes(jax.value_and_grad(loss), c, x, y)

    assert not has_nm(shapes("fft", grad=False))
    assert not has_nm(shapes("fft", grad=True))  # forward, backward and the transposed product
    assert has_nm(shapes("dense", grad=False))  # the check can fail: the dense path forms ΔW
