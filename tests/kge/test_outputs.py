"""Output layers: mixture-of-softmaxes identities, losses against float64 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.kge.outputs import (
    init_output,
    mixture_of_softmaxes,
    output_log_probs,
    output_loss,
    output_scores,
)


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_mixture_with_one_component_is_linear_softmax():
    logits = jax.random.normal(jax.random.key(0), (4, 1, 9)) * 3
    prior = jax.random.normal(jax.random.key(1), (4, 1))
    got = mixture_of_softmaxes(logits, prior)
    np.testing.assert_allclose(got, jax.nn.log_softmax(logits[:, 0]), atol=1e-6)
    np.testing.assert_allclose(got, _log_softmax64(logits[:, 0]), atol=1e-5)


def test_mixture_matches_float64_reference_and_normalises():
    logits = np.random.default_rng(0).normal(size=(3, 4, 7)) * 2
    prior = np.random.default_rng(1).normal(size=(3, 4))
    got = mixture_of_softmaxes(jnp.asarray(logits, jnp.float32), jnp.asarray(prior, jnp.float32))
    ref = np.log(
        np.einsum("bk,bke->be", np.exp(_log_softmax64(prior)), np.exp(_log_softmax64(logits)))
    )
    np.testing.assert_allclose(got, ref, atol=1e-5)
    np.testing.assert_allclose(jax.nn.logsumexp(got, axis=-1), 0.0, atol=1e-5)
    # identical components: the mixture is that softmax, whatever the weights
    same = np.repeat(logits[:, :1], 4, axis=1)
    np.testing.assert_allclose(
        mixture_of_softmaxes(jnp.asarray(same), jnp.asarray(prior)),
        _log_softmax64(same[:, 0]),
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="expected component_logits"):
        mixture_of_softmaxes(jnp.zeros((3, 7)), jnp.zeros((3,)))


def test_mos_layer_matches_reference_and_extra_params():
    d, k, e = 5, 3, 11
    params = init_output(jax.random.key(0), output="mos", dim=d, num_components=k)
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), params)
    n_extra = sum(x.size for x in jax.tree.leaves(params))
    assert n_extra == k * (d * d + d) + k * d  # independent of the number of entities
    h = np.random.default_rng(0).normal(size=(2, d))
    ent = np.random.default_rng(1).normal(size=(e, d))
    got = output_scores(
        params, jnp.asarray(ent, jnp.float32), jnp.asarray(h, jnp.float32), output="mos"
    )
    p = {n: np.asarray(v, np.float64) for n, v in params.items()}
    f = np.tanh(np.einsum("bi,kij->bkj", h, p["proj_kernel"]) + p["proj_bias"])
    pi = np.exp(_log_softmax64(h @ p["prior_kernel"]))
    ref = np.log(np.einsum("bk,bke->be", pi, np.exp(_log_softmax64(f @ ent.T))))
    np.testing.assert_allclose(got, ref, atol=1e-5)
    # log_softmax of MoS scores leaves them unchanged
    np.testing.assert_allclose(output_log_probs(got, output="mos"), got, atol=1e-5)


def test_losses_match_float64_reference():
    scores = np.random.default_rng(0).normal(size=(3, 6))
    labels = np.zeros((3, 6), np.float32)
    labels[0, [1, 2]] = 1
    labels[1, 0] = 1
    labels[2, [0, 3, 5]] = 1
    ce = output_loss(jnp.asarray(scores, jnp.float32), jnp.asarray(labels), output="softmax")
    ref_ce = -(labels * _log_softmax64(scores)).sum(1) / labels.sum(1)
    np.testing.assert_allclose(ce, ref_ce, atol=1e-5)
    bce = output_loss(jnp.asarray(scores, jnp.float32), jnp.asarray(labels), output="sigmoid")
    sig = 1 / (1 + np.exp(-scores))
    ref_bce = -(labels * np.log(sig) + (1 - labels) * np.log(1 - sig)).mean(1)
    np.testing.assert_allclose(bce, ref_bce, atol=1e-5)


def test_linear_layers_and_errors():
    h = jnp.ones((2, 3))
    ent = jnp.arange(12.0).reshape(4, 3)
    assert init_output(jax.random.key(0), output="softmax", dim=3) == {}
    np.testing.assert_allclose(output_scores({}, ent, h, output="sigmoid"), h @ ent.T)
    with pytest.raises(ValueError, match="unknown output"):
        init_output(jax.random.key(0), output="linear", dim=3)
    with pytest.raises(ValueError, match="use 'mos'"):
        init_output(jax.random.key(0), output="softmax", dim=3, num_components=2)
