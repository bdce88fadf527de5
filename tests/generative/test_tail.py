"""CVaR, its KL dual and the tilt (P16 stage 1) against definitions and the discrete toy of §16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.generative import tail


def _cvar_ru(r, p, beta, side):
    """Rockafellar–Uryasev by brute force over every atom as threshold (float64 NumPy)."""
    if side == "right":
        return min(e + np.sum(p * np.maximum(r - e, 0)) / beta for e in r)
    return max(e - np.sum(p * np.maximum(e - r, 0)) / beta for e in r)


@pytest.mark.parametrize("side", tail.TAILS)
@pytest.mark.parametrize("weighted", [False, True])
def test_cvar_equals_the_rockafellar_uryasev_form(side, weighted):
    rng = np.random.default_rng(0)
    r = rng.normal(size=97)
    p = rng.uniform(0.1, 1, size=97) if weighted else np.ones(97)
    p = p / p.sum()
    got = tail.cvar(r.astype(np.float32), beta=0.13, tail=side, weights=p if weighted else None)
    np.testing.assert_allclose(float(got), _cvar_ru(r, p, 0.13, side), rtol=1e-5, atol=1e-5)


def test_uniform_cvar_is_the_mean_of_the_tail():
    r = np.arange(100, dtype=np.float32)
    assert float(tail.cvar(r, beta=0.1, tail="right")) == pytest.approx(np.mean(r[-10:]))
    assert float(tail.cvar(r, beta=0.1, tail="left")) == pytest.approx(np.mean(r[:10]))


def _discrete_toy():
    # specs.md §16 "numerical check": a discrete law on K = 60 atoms, alpha = 0.5, beta = 0.1.
    rng = np.random.default_rng(1)
    r = rng.normal(size=60) * 2
    p = rng.dirichlet(np.ones(60))
    return r, p, 0.5, 0.1


@pytest.mark.parametrize("side", tail.TAILS)
def test_the_dual_value_is_the_primal_objective_of_the_tilted_law(side):
    r, p, alpha, beta = _discrete_toy()
    r32 = r.astype(np.float32)
    eta = tail.cvar_threshold(r32, beta=beta, alpha=alpha, tail=side, weights=p)
    dual = float(tail.cvar_dual_objective(eta, r32, beta=beta, alpha=alpha, tail=side, weights=p))
    q = np.asarray(
        tail.tilt_weights(
            tail.pseudo_reward(r32, eta, beta=beta, tail=side), alpha=alpha, weights=p
        ),
        np.float64,
    )
    kl = float(tail.tilt_kl(q, weights=p))
    pos = q > 0  # atoms far below a left threshold underflow to probability 0
    np.testing.assert_allclose(kl, np.sum(q[pos] * np.log(q[pos] / p[pos])), rtol=1e-4)
    primal = _cvar_ru(r, q, beta, side) - alpha * kl
    assert primal == pytest.approx(dual, abs=2e-3)
    # eta* is the optimum of Phi: nudging it either way does not improve the dual.
    for d in (-0.05, 0.05):
        other = float(
            tail.cvar_dual_objective(eta + d, r32, beta=beta, alpha=alpha, tail=side, weights=p)
        )
        assert (other >= dual - 1e-5) if side == "right" else (other <= dual + 1e-5)
    # and no other law on the atoms does better on the primal (random tilts of p).
    rng = np.random.default_rng(2)
    for _ in range(200):
        other = p * np.exp(rng.normal(size=60) * rng.uniform(0, 3))
        other /= other.sum()
        value = _cvar_ru(r, other, beta, side) - alpha * np.sum(other * np.log(other / p))
        assert value <= primal + 1e-3


def test_left_tfft_raises_the_lower_tail():
    r, p, alpha, beta = _discrete_toy()
    eta = tail.cvar_threshold(r, beta=beta, alpha=alpha, tail="left", weights=p)
    q = tail.tilt_weights(
        tail.pseudo_reward(r, eta, beta=beta, tail="left"), alpha=alpha, weights=p
    )
    before = float(tail.cvar(r, beta=beta, tail="left", weights=p))
    after = float(tail.cvar(r, beta=beta, tail="left", weights=q))
    assert after > before + 0.5
    # flat above the threshold: atoms above eta keep their relative probabilities.
    above = r > float(eta)
    np.testing.assert_allclose(
        np.asarray(q)[above] / p[above], (np.asarray(q)[above] / p[above])[0], rtol=1e-4
    )


def test_alpha_for_kl_hits_the_target_and_refuses_unreachable_ones():
    r = np.random.default_rng(3).normal(size=500).astype(np.float32)

    def kl(a):
        return float(tail.tilt_kl(tail.tilt_weights(r, alpha=a)))

    alpha = tail.alpha_for_kl(kl, target_kl=0.3)
    assert kl(alpha) == pytest.approx(0.3, rel=1e-3)
    with pytest.raises(ValueError, match="outside the reachable range"):
        tail.alpha_for_kl(kl, target_kl=50.0)


@pytest.mark.parametrize("weighted", [False, True])
def test_tilt_for_kl_reaches_the_budget_against_a_float64_reference(weighted):
    rng = np.random.default_rng(4)
    r = rng.normal(size=500).astype(np.float32)
    p = rng.dirichlet(np.ones(500)) if weighted else np.full(500, 1 / 500)
    alpha, r_tilde = tail.tilt_for_kl(
        lambda a: r, target_kl=0.3, weights=p.astype(np.float32) if weighted else None
    )
    np.testing.assert_array_equal(np.asarray(r_tilde), r)  # alpha-free pseudo-reward: r itself
    q = p * np.exp((r.astype(np.float64) - r.max()) / alpha)
    q /= q.sum()
    assert np.sum(q * np.log(q / p)) == pytest.approx(0.3, rel=1e-3)


def test_tilt_for_kl_is_alpha_for_kl_with_the_pseudo_reward_evaluated_at_alpha():
    r = np.random.default_rng(5).normal(size=1000).astype(np.float32)
    calls = []

    def pseudo(a):  # TFFT's right tail: the threshold depends on alpha
        calls.append(a)
        eta = tail.cvar_threshold(r, beta=0.1, alpha=a, tail="right")
        return tail.pseudo_reward(r, eta, beta=0.1, tail="right")

    alpha, r_tilde = tail.tilt_for_kl(pseudo, target_kl=0.2, bounds=(1e-3, 1e3))
    assert calls[-1] == alpha
    np.testing.assert_array_equal(np.asarray(r_tilde), np.asarray(pseudo(alpha)))
    expected = tail.alpha_for_kl(
        lambda a: float(tail.tilt_kl(tail.tilt_weights(pseudo(a), alpha=a))),
        target_kl=0.2,
        bounds=(1e-3, 1e3),
    )
    assert alpha == expected
    kl = float(tail.tilt_kl(tail.tilt_weights(r_tilde, alpha=alpha)))
    assert kl == pytest.approx(0.2, abs=0.05)  # a thresholded tilt's KL jumps on a finite sample
    with pytest.raises(ValueError, match="outside the reachable range"):
        tail.tilt_for_kl(pseudo, target_kl=50.0, bounds=(1e-3, 1e3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(beta=1.5, tail="left"), r"beta=1.5 is invalid: the tail level must lie in \(0, 1\)"),
        (dict(beta=0.0, tail="right"), "beta=0.0 is invalid"),
        (dict(beta=0.1, tail="upper"), "tail='upper' is invalid"),
    ],
)
def test_bad_tail_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tail.cvar(np.zeros(4), **kwargs)


def test_reward_log_tilt_gradient_is_the_masked_reward_gradient():
    # ∇(r̃/α) = α⁻¹β⁻¹·1[r ≷ η]·∇r for TFFT, α⁻¹∇r for expected-reward fine-tuning.
    def reward(x):
        return jnp.sin(x[:, 0]) + 0.5 * x[:, 1] ** 2

    x = jax.random.normal(jax.random.key(0), (64, 2))
    r, beta, args = reward(x), 0.1, {"eta": jnp.float32(0.2), "alpha": jnp.float32(2.0)}
    grad_r = jax.grad(lambda y: jnp.sum(reward(y)))(x)
    for side, mask in (("right", r > 0.2), ("left", r < 0.2), (None, None)):
        f = tail.reward_log_tilt(reward, beta=beta, tail=side)
        same = tail.reward_log_tilt(reward, beta=beta, tail=side)
        assert f == same and hash(f) == hash(same)  # equal values: one compile
        got = jax.grad(lambda y, f=f: jnp.sum(f(y, args)))(x)
        scale = 1.0 / 2.0 if mask is None else mask[:, None] / (2.0 * beta)
        np.testing.assert_allclose(got, scale * grad_r, rtol=1e-5, atol=1e-6)
        assert mask is None or 0 < int(mask.sum()) < 64  # both sides of the threshold occur
    with pytest.raises(ValueError, match="tail"):
        tail.reward_log_tilt(reward, beta=beta, tail="up")
