"""Mixed-adapter batches: a bank of adapters, one per example, equal to each adapter alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters as A
from tests.adapters.models import Block, Scanned, plain_function, plain_params

B, T = 5, 3
IDS = jnp.array([2, 0, 3, 2, 1])


def _random(ads, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda f: jnp.asarray(rng.normal(size=f.shape) * 0.3, f.dtype), ads)


def _sets(params, rules_per_set):
    return [_random(A.init(jax.random.key(i), params, r), i) for i, r in enumerate(rules_per_set)]


def _alone(fwd, params, sets, x, ids):
    """Each example run alone with its own adapter set (the reference)."""
    return jnp.concatenate(
        [fwd(params, sets[int(j)], x[i : i + 1]) for i, j in enumerate(np.asarray(ids))]
    )


BLOCK_RULES = [
    (r".*fc1/kernel", A.lora(2)),
    (r".*qkv/kernel", A.lora(2, in_ndim=1)),
    (r".*out/kernel", A.lora(2, out_ndim=1, rslora=True)),
]


@pytest.mark.parametrize("backend", ["quax", "linen"])
def test_bank_equals_each_adapter_alone(backend):
    model = Block()
    x = jax.random.normal(jax.random.key(9), (B, T, 4))
    variables = model.init(jax.random.key(0), x)
    wide = [
        (p, A.lora(3, alpha=1.5, in_ndim=s.in_ndim, out_ndim=s.out_ndim)) for p, s in BLOCK_RULES
    ]
    sets = _sets(variables, [BLOCK_RULES, BLOCK_RULES, wide, BLOCK_RULES])  # ranks 2 and 3 mixed
    bank = A.stack_adapters(sets)
    fwd = A.adapt(model.apply, backend=backend)
    got = jax.jit(fwd)(variables, bank, x, adapter_ids=IDS)
    np.testing.assert_allclose(got, _alone(fwd, variables, sets, x, IDS), atol=1e-5)


def test_bank_on_scanned_layers_and_transposed_use():
    model = Scanned()
    x = jax.random.normal(jax.random.key(9), (B, 4))
    variables = model.init(jax.random.key(0), x)
    rules = [
        (r".*layers/dense/kernel", A.lora(2, in_ndim=1, out_ndim=1)),
        (r".*head/kernel", A.lora(2)),
    ]
    sets = _sets(variables, [rules] * 4)
    fwd = A.adapt(model.apply)
    got = jax.jit(fwd)(variables, A.stack_adapters(sets), x, adapter_ids=IDS)
    np.testing.assert_allclose(got, _alone(fwd, variables, sets, x, IDS), atol=1e-5)
    # plain JAX: lax.scan over stacked kernels, remat, and a tied-embedding (x @ E.T) use
    p, plain_rules = plain_params()
    sets = _sets(p, [plain_rules] * 4)
    fwd = A.adapt(plain_function)
    xs = jax.random.normal(jax.random.key(2), (B, 8))
    got = jax.jit(fwd)(p, A.stack_adapters(sets), xs, adapter_ids=IDS)
    np.testing.assert_allclose(got, _alone(fwd, p, sets, xs, IDS), atol=1e-5)


def test_swapping_an_adapter_or_the_ids_does_not_recompile():
    model = Block()
    x = jax.random.normal(jax.random.key(9), (B, T, 4))
    variables = model.init(jax.random.key(0), x)
    sets = _sets(variables, [BLOCK_RULES] * 4)
    traces = []
    fwd = A.adapt(model.apply)

    @jax.jit
    def serve(params, bank, x, ids):
        traces.append(1)  # runs once per compilation
        return fwd(params, bank, x, adapter_ids=ids)

    serve(variables, A.stack_adapters(sets), x, IDS)
    swapped = [*sets[:2], _random(sets[2], seed=42), sets[3]]  # a new adapter in slot 2
    ids = jnp.array([2, 2, 1, 0, 3])
    got = serve(variables, A.stack_adapters(swapped), x, ids)
    assert len(traces) == 1
    np.testing.assert_allclose(got, _alone(fwd, variables, swapped, x, ids), atol=1e-5)


def test_gradients_reach_only_the_selected_adapters():
    model = Block()
    x = jax.random.normal(jax.random.key(9), (B, T, 4))
    variables = model.init(jax.random.key(0), x)
    sets = _sets(variables, [BLOCK_RULES] * 6)  # adapters 4 and 5 unused by IDS
    fwd = A.adapt(model.apply)
    grads = jax.grad(lambda bank: jnp.sum(fwd(variables, bank, x, adapter_ids=IDS) ** 2))(
        A.stack_adapters(sets)
    )
    for g in jax.tree.leaves(grads):
        per_adapter = np.abs(np.asarray(g)).reshape(6, -1).sum(1)
        assert np.all(per_adapter[:4] > 0) and np.all(per_adapter[4:] == 0)


def test_bad_input_raises():
    model = Block()
    x = jax.random.normal(jax.random.key(9), (B, T, 4))
    variables = model.init(jax.random.key(0), x)
    sets = _sets(variables, [BLOCK_RULES] * 2)
    bank = A.stack_adapters(sets)
    fwd = A.adapt(model.apply)
    with pytest.raises(ValueError, match="needs adapter_ids"):
        fwd(variables, bank, x)
    with pytest.raises(ValueError, match="not an adapter bank"):
        fwd(variables, sets[0], x, adapter_ids=IDS)
    with pytest.raises(ValueError, match="leading axis"):
        fwd(variables, bank, x, adapter_ids=jnp.array([0, 1]))
    with pytest.raises(TypeError, match="integers"):
        fwd(variables, bank, x, adapter_ids=jnp.zeros((B,)))
    with pytest.raises(ValueError, match="not one ΔW"):
        A.fold(variables, bank)
    with pytest.raises(ValueError, match="same paths"):
        A.stack_adapters([sets[0], {k: v for k, v in list(sets[1].items())[:1]}])


def test_bank_under_a_bfloat16_cast_keeps_integer_ids():
    p = {"w": jax.random.normal(jax.random.key(0), (8, 6))}
    rules = [("w", A.lora(2))]
    sets = _sets(p, [rules] * 3)
    fwd = A.adapt(lambda q, x: x.astype(jnp.bfloat16) @ q["w"].astype(jnp.bfloat16))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    ids = jnp.array([1, 2, 0, 1])
    got = jax.jit(fwd)(p, A.stack_adapters(sets), x, adapter_ids=ids)
    assert got.dtype == jnp.bfloat16
    want = _alone(fwd, p, sets, x, ids)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_mixed_forward_of_the_scanned_decoder_lowers_for_tpu_and_gpu():
    """Accelerator readiness: the jitted mixed-adapter forward exports for TPU and CUDA with no
    host callback and no float64 (``experiments/common/lowering.py``)."""
    from experiments.common import lowering
    from lowrank_jax import models

    config = models.DecoderConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = models.DecoderLM(config)
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    rules = [(r".*_proj/kernel", A.lora(4, in_ndim=1, out_ndim=1))]
    bank = jax.eval_shape(
        lambda v: A.stack_adapters([A.init(jax.random.key(i), v, rules) for i in range(3)]),
        variables,
    )
    fwd = A.adapt(model.apply)
    step = lowering.Step(
        "mixed-adapter forward",
        jax.jit(lambda v, b, t, i: fwd(v, b, t, adapter_ids=i)),
        (variables, bank, tokens, jax.ShapeDtypeStruct((4,), jnp.int32)),
    )
    assert lowering.lower_and_check(step) == []


def test_bank_partition_specs_and_dropout():
    from jax.sharding import PartitionSpec as P

    p = {"stack": jnp.zeros((3, 8, 6)), "w": jnp.zeros((8, 6))}
    rules = [
        ("stack", A.lora(2, in_ndim=1, out_ndim=1, dropout=0.5)),
        ("w", A.lora(2, dropout=0.5)),
    ]
    sets = _sets(p, [rules] * 4)
    bank = A.stack_adapters(sets)
    specs = A.partition_specs(bank, {"stack": P(None, "data", "model"), "w": P("data", "model")})
    # the adapter axis (after the stacked-layer axis) is replicated, the factors split as LoRA's
    assert specs["stack"].factors == {
        "a": P(None, None, "data", None),
        "b": P(None, None, None, "model"),
    }
    assert specs["w"].factors == {"a": P(None, "data", None), "b": P(None, None, "model")}
    fwd = A.adapt(lambda q, x: x @ q["w"])
    x = jnp.ones((4, 8))
    ids = jnp.array([0, 1, 2, 3])
    plain = fwd(p, bank, x, adapter_ids=ids)
    dropped = fwd(p, bank, x, adapter_ids=ids, adapter_key=jax.random.key(0))
    again = fwd(p, bank, x, adapter_ids=ids, adapter_key=jax.random.key(0))
    np.testing.assert_array_equal(dropped, again)  # seeded
    assert not np.allclose(dropped, plain)  # dropout is active on the adapter input


def test_out_of_range_ids_and_dora_sets_are_refused():
    model = Block()
    x = jax.random.normal(jax.random.key(9), (B, T, 4))
    variables = model.init(jax.random.key(0), x)
    bank = A.stack_adapters(_sets(variables, [BLOCK_RULES] * 2))
    fwd = A.adapt(model.apply)
    for ids in ([0, 1, 2, 0, 1][:B], [0, -1, 0, 1, 1][:B]):
        with pytest.raises(ValueError, match=r"must lie in \[0, 2\)"):
            fwd(variables, bank, x, adapter_ids=jnp.array(ids))
    dora_rules = [(r".*fc1/kernel", A.dora(2))]
    with pytest.raises(TypeError, match="DoRA"):
        A.stack_adapters(_sets(variables, [dora_rules] * 2))
