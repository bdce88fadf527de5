"""Data-aware initialisers: K-FAC statistics, LoRA-DA's natural-gradient subspace, and every
initialiser's folded weight against its documented formula (float64 NumPy references)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters as A
from lowrank_jax.adapters.kfac import kfac_statistics

N_IN, N_OUT, N_EX = 8, 6, 64
PATH = "w/kernel"


def _problem(seed=0):
    """A linear least-squares layer with anisotropic inputs: ½‖x W − y‖² per example."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_EX, N_IN)) * np.geomspace(3.0, 0.3, N_IN)
    w = rng.standard_normal((N_IN, N_OUT)) * 0.3
    y = x @ rng.standard_normal((N_IN, N_OUT)) + 0.1 * rng.standard_normal((N_EX, N_OUT))
    y = y * np.geomspace(2.0, 0.5, N_OUT)
    return {"w": {"kernel": w.astype(np.float32)}}, {
        "x": x.astype(np.float32),
        "y": y.astype(np.float32),
    }


def apply_fn(params, x):
    return x @ params["w"]["kernel"]


def loss_fn(forward, batch):
    return 0.5 * jnp.mean(jnp.sum((forward(batch["x"]) - batch["y"]) ** 2, -1))


def _reference_stats(params, batch):
    x, y = (np.asarray(batch[k], np.float64) for k in ("x", "y"))
    g_out = x @ np.asarray(params["w"]["kernel"], np.float64) - y  # per-example output gradient
    return x.T @ g_out / N_EX, x.T @ x / N_EX, np.mean(g_out**2, axis=0)


def _natural_gradient(g, z, f, damping=1e-6):
    d = -np.linalg.solve(z + damping * np.eye(N_IN), g) / (f + damping)
    return d / np.linalg.norm(d, 2)


def _projector(a):
    q, _ = np.linalg.qr(np.asarray(a, np.float64))
    return q @ q.T


KW = dict(apply_fn=apply_fn, loss_fn=loss_fn)


def test_kfac_statistics_match_per_example_reference():
    params, batch = _problem()
    st = kfac_statistics(params, [(PATH, A.lora(2))], batch, chunk_size=5, **KW)[PATH]
    g, z, f = _reference_stats(params, batch)
    np.testing.assert_allclose(st.grad, g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st.z, z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st.f, f, rtol=1e-5, atol=1e-5)
    assert float(st.tokens) == N_EX


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_lora_da_recovers_the_natural_gradient_subspace(rank):
    params, batch = _problem()
    ad = A.lora_da(jax.random.key(0), params, [(PATH, A.lora(rank))], batch, beta=0.0, **KW)[PATH]
    g, z, f = _reference_stats(params, batch)
    delta = _natural_gradient(g, z, f)
    u = np.linalg.svd(delta)[0][:, :rank]
    np.testing.assert_allclose(_projector(ad.factors["a"]), u @ u.T, atol=1e-4)
    # The natural-gradient subspace differs from the plain gradient's (which LoRA-One takes).
    one = A.lora_one(jax.random.key(0), params, [(PATH, A.lora(rank))], batch, **KW)[PATH]
    assert np.abs(_projector(one.factors["a"]) - u @ u.T).max() > 0.05


def test_lora_da_merged_weight_is_its_formula():
    params, batch = _problem()
    rank, beta, gamma, n_train = 3, 0.03, 1024.0, 500
    spec = A.lora(rank, alpha=16.0, rslora=True)
    ad = A.lora_da(
        jax.random.key(0), params, [(PATH, spec)], batch, beta=beta, gamma=gamma,
        num_train=n_train, **KW,
    )  # fmt: skip
    g, z, f = _reference_stats(params, batch)
    zd, fd = z + 1e-6 * np.eye(N_IN), f + 1e-6
    raw = -np.linalg.solve(zd, g) / fd
    s = np.linalg.norm(raw, 2)
    delta = raw / s
    c = np.sum(1 / fd) / n_train / s**2
    omega = -(delta @ delta.T) + beta * c * np.linalg.inv(zd)
    a0 = np.linalg.eigh(omega)[1][:, :rank]
    expected = spec.scale * a0 @ a0.T @ delta / gamma
    folded = A.fold(params, ad)["w"]["kernel"] - params["w"]["kernel"]
    np.testing.assert_allclose(folded, expected, atol=1e-6)
    # W₀ is not modified: the adapters alone carry the initial step, with orthonormal a₀.
    np.testing.assert_allclose(
        ad[PATH].factors["a"].T @ ad[PATH].factors["a"] * gamma, np.eye(rank), atol=1e-5
    )


def test_lora_one_merged_weight_is_its_formula():
    params, batch = _problem()
    spec, gamma = A.lora(2, alpha=4.0), 64.0
    ad = A.lora_one(jax.random.key(0), params, [(PATH, spec)], batch, gamma=gamma, **KW)
    g, _, _ = _reference_stats(params, batch)
    u, sv, vt = np.linalg.svd(g)
    expected = -spec.scale * (u[:, :2] * sv[:2]) @ vt[:2] / sv[0] / gamma
    np.testing.assert_allclose(A.delta(ad[PATH], (N_IN, N_OUT)), expected, atol=1e-6)


def test_lora_ga_factors_and_unmerge_start_at_the_base_model():
    params, batch = _problem()
    spec, gamma, r = A.lora(2, alpha=8.0), 16.0, 2
    ad = A.lora_ga(jax.random.key(0), params, [(PATH, spec)], batch, gamma=gamma, **KW)
    g, _, _ = _reference_stats(params, batch)
    u, _, vt = np.linalg.svd(g)
    c = N_OUT**0.25 / math.sqrt(gamma)
    a, b = (np.asarray(ad[PATH].factors[k], np.float64) / c for k in ("a", "b"))
    np.testing.assert_allclose(a.T @ a, np.eye(r), atol=1e-5)
    np.testing.assert_allclose(_projector(a), u[:, :r] @ u[:, :r].T, atol=1e-4)
    np.testing.assert_allclose(_projector(b.T), vt[r : 2 * r].T @ vt[r : 2 * r], atol=1e-4)
    # Merged update s·√m/γ·Σ ±L_i R_{r+i}ᵀ: Frobenius norm s·√m·√r/γ.
    folded = np.asarray(A.delta(ad[PATH], (N_IN, N_OUT)))
    np.testing.assert_allclose(
        np.linalg.norm(folded), spec.scale * math.sqrt(N_OUT) * math.sqrt(r) / gamma, rtol=1e-5
    )
    base = A.unfold(params, ad)
    out = A.adapt(apply_fn)(base, ad, batch["x"])
    np.testing.assert_allclose(out, apply_fn(params, batch["x"]), atol=1e-5)


def test_pissa_merged_weight_is_the_principal_part():
    params, batch = _problem()
    ad = A.init(jax.random.key(0), params, [(PATH, A.lora(3, alpha=6.0, init="pissa"))])
    w = np.asarray(params["w"]["kernel"], np.float64)
    u, sv, vt = np.linalg.svd(w)
    np.testing.assert_allclose(A.delta(ad[PATH], w.shape), (u[:, :3] * sv[:3]) @ vt[:3], atol=1e-5)


def test_eva_components_and_rank_redistribution():
    params, batch = _problem()
    ad = A.eva(jax.random.key(0), params, [(PATH, A.lora(2))], batch, rho=1.0, **KW)[PATH]
    _, z, _ = _reference_stats(params, batch)
    top = np.linalg.eigh(z)[1][:, ::-1][:, :2]
    np.testing.assert_allclose(_projector(ad.factors["a"]), top @ top.T, atol=1e-4)
    np.testing.assert_array_equal(ad.factors["b"], 0.0)
    np.testing.assert_allclose(A.delta(ad, (N_IN, N_OUT)), 0.0)
    # Redistribution: two layers with different activation spectra: flat inputs of w (ratios
    # 0.19, 0.17, 0.16, ...), a spiky and 100x larger hidden layer (0.93, 0.04, 0.02, ...). The
    # ratio rule moves the budget to w (3, 1); ranking raw eigenvalues λ_i instead of λ_i/Σλ
    # (a plausible bug) would move it to v.
    w_spiky = params["w"]["kernel"] * np.geomspace(30.0, 1.0, N_OUT).astype(np.float32)
    two = {"w": {"kernel": w_spiky}, "v": {"kernel": params["w"]["kernel"].T}}
    flat = np.random.default_rng(5).standard_normal((N_EX, N_IN)).astype(np.float32)
    batch = {"x": flat}

    def apply2(p, x):
        return (x @ p["w"]["kernel"]) @ p["v"]["kernel"]

    rules = [(r"(w|v)/kernel", A.lora(2))]
    loss2 = lambda fwd, b: jnp.mean(fwd(b["x"]) ** 2)
    ad2 = A.eva(jax.random.key(0), two, rules, batch, apply_fn=apply2, loss_fn=loss2, rho=2.0)
    ranks = {p: a.kind.rank for p, a in ad2.items()}
    want = _eva_ranks_reference(two, batch, {"w/kernel": 2, "v/kernel": 2}, rho=2.0)
    assert want == {"w/kernel": 3, "v/kernel": 1}
    assert ranks == want
    for p, a in ad2.items():  # each kernel's A₀ spans its top-r eigenvectors of Z
        top = _eva_z(two, batch)[p]
        top = np.linalg.eigh(top)[1][:, ::-1][:, : want[p]]
        np.testing.assert_allclose(_projector(a.factors["a"]), top @ top.T, atol=1e-4)


def _eva_z(params, batch):
    """float64 ``Z = E[a aᵀ]`` of the inputs of ``w`` and ``v`` in ``apply2``."""
    x = np.asarray(batch["x"], np.float64)
    h = x @ np.asarray(params["w"]["kernel"], np.float64)
    return {"w/kernel": x.T @ x / len(x), "v/kernel": h.T @ h / len(h)}


def _eva_ranks_reference(params, batch, ranks, *, rho):
    """EVA's rule in NumPy: keep the components with the largest explained-variance ratios
    ``λ_i/Σλ`` over all kernels, total = Σ r_l, at most ⌊ρ r_l⌋ and at least one per kernel."""
    cands = []
    for p, z in _eva_z(params, batch).items():
        lam = np.linalg.eigvalsh(z)[::-1]
        cap = min(int(rho * ranks[p]), len(lam))
        cands += [(lam[i] / lam.sum(), p) for i in range(1, cap)]  # component 0 is always kept
    extra = sum(ranks.values()) - len(ranks)
    out = dict.fromkeys(ranks, 1)
    for _, p in sorted(cands, reverse=True)[:extra]:
        out[p] += 1
    return out


def test_initialiser_errors():
    params, batch = _problem()
    with pytest.raises(TypeError, match="LoRA adapters"):
        A.lora_da(jax.random.key(0), params, [(PATH, A.frameft(4))], batch, **KW)
    with pytest.raises(ValueError, match="2·rank"):
        A.lora_ga(jax.random.key(0), params, [(PATH, A.lora(4))], batch, **KW)
    with pytest.raises(ValueError, match="num_examples"):
        kfac_statistics(params, [(PATH, A.lora(2))], batch, num_examples=0, **KW)
