"""Our TIES and DARE against PEFT's ``add_weighted_adapter`` on the same two LoRAs (peers extra).

* ``combination_type="ties_svd"`` and ``"dare_linear_svd"`` merge the *products* ``s·BA`` like we
  do, then truncate by SVD: equal to ours (TIES with ``trim="per_kernel"``: PEFT ranks magnitudes
  module by module, our default ranks each whole task vector as the TIES paper; DARE with PEFT's
  own ``torch.bernoulli`` masks injected, as the two RNGs differ).
* ``"ties"``, ``"dare_linear"`` and ``"linear"`` merge ``A`` and ``B`` *separately*: the merged
  product carries cross terms ``B_i A_j`` (i ≠ j). Our per-tensor steps applied to the stacked
  factors reproduce PEFT's factors exactly, so the *only* difference is the object merged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters, merging
from lowrank_jax.merging.sparsify import (
    dare_delta,
    dare_masks,
    dare_ties_delta,
    magnitude_prune_delta,
    ties_delta,
)
from lowrank_jax.merging.task_vectors import task_vector_matrices
from lowrank_jax.spectral.svd import balanced_factors

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

DIMS = {"l0": (7, 6), "l1": (6, 5)}  # (in, out)
RANK, ALPHA = 3, 6.0  # PEFT scaling alpha / r = 2


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(*DIMS["l0"])
        self.l1 = torch.nn.Linear(*DIMS["l1"])

    def forward(self, x):
        return self.l1(self.l0(x))


def _setup(seed=0):
    """A PEFT model with adapters "t1" and "t2" (random A, B), and the same two as our sets."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["l0", "l1"])
    model = peft.get_peft_model(_Net(), config, adapter_name="t1")
    model.add_adapter("t2", config)
    params = {n: {"kernel": jnp.zeros(d)} for n, d in DIMS.items()}
    ours = {}
    rng = np.random.default_rng(seed)
    for name in ("t1", "t2"):
        ads = adapters.init(
            jax.random.key(0), params, [(r".*kernel", adapters.lora(rank=RANK, alpha=ALPHA))]
        )
        for layer in DIMS:
            module = getattr(model.base_model.model, layer)
            a = rng.normal(size=module.lora_A[name].weight.shape).astype(np.float32)
            b = rng.normal(size=module.lora_B[name].weight.shape).astype(np.float32)
            with torch.no_grad():
                module.lora_A[name].weight.copy_(torch.from_numpy(a))
                module.lora_B[name].weight.copy_(torch.from_numpy(b))
            path = f"{layer}/kernel"  # ours: x @ W, W = torch weight.T; a = A.T, b = B.T
            ads[path] = ads[path].replace(factors={"a": jnp.asarray(a.T), "b": jnp.asarray(b.T)})
        ours[name] = ads
    return model, ours


def _peft_delta(model, name, layer):
    module = getattr(model.base_model.model, layer)
    return module.get_delta_weight(name).detach().numpy().T  # (in, out), our orientation


def test_ties_equals_peft_ties_svd():
    model, ours = _setup()
    weights, density, rank = [1.0, 0.6], 0.5, 3
    model.add_weighted_adapter(
        ["t1", "t2"], weights, "m", combination_type="ties_svd", density=density, svd_rank=rank
    )
    merged = merging.merge_ties(
        [ours["t1"], ours["t2"]], weights=weights, density=density, rank=rank, trim="per_kernel"
    )
    for layer, shape in DIMS.items():
        got = np.asarray(adapters.delta(merged[f"{layer}/kernel"], shape))
        np.testing.assert_allclose(got, _peft_delta(model, "m", layer), atol=2e-5)


def test_dare_equals_peft_dare_linear_svd_with_its_masks(monkeypatch):
    model, ours = _setup(seed=1)
    drawn = []
    bernoulli = torch.bernoulli

    def record(p, *args, **kwargs):
        mask = bernoulli(p, *args, **kwargs)
        drawn.append(mask.numpy().T.astype(bool))
        return mask

    monkeypatch.setattr(torch, "bernoulli", record)
    weights, density, rank = [0.8, 1.2], 0.4, 2
    torch.manual_seed(3)
    model.add_weighted_adapter(
        ["t1", "t2"],
        weights,
        "m",
        combination_type="dare_linear_svd",
        density=density,
        svd_rank=rank,
    )
    assert len(drawn) == 2 * len(DIMS)  # one mask per (layer, adapter), in module order
    views = task_vector_matrices([ours["t1"], ours["t2"]])
    for i, layer in enumerate(DIMS):
        deltas = views[f"{layer}/kernel"][0][:, 0]  # (2, n, m)
        keep = jnp.asarray(np.stack(drawn[2 * i : 2 * i + 2]))
        merged = dare_delta(deltas, keep, density=density, weights=weights)
        a, b = balanced_factors(merged, rank=rank)
        np.testing.assert_allclose(np.asarray(a @ b), _peft_delta(model, "m", layer), atol=2e-5)
    # and our own masks keep the same expected fraction
    ours_merged = merging.merge_dare([ours["t1"], ours["t2"]], jax.random.key(0), density=density)
    assert set(ours_merged) == {f"{layer}/kernel" for layer in DIMS}


@pytest.mark.parametrize("combination", ["linear", "ties"])
def test_peft_factorwise_merges_differ_only_by_merging_factors(combination):
    model, ours = _setup(seed=2)
    weights, density = [1.0, 0.5], 0.6
    kwargs = {"density": density} if combination == "ties" else {}
    model.add_weighted_adapter(["t1", "t2"], weights, "m", combination_type=combination, **kwargs)
    scale = ALPHA / RANK
    # PEFT weights A by sign(w)·sqrt(|w s|) and B by sqrt(|w s|), merges each stack separately
    root = np.sqrt(np.abs(np.asarray(weights) * scale))
    for layer, shape in DIMS.items():
        path = f"{layer}/kernel"
        a_stack = jnp.stack([ours[n][path].factors["a"].T for n in ("t1", "t2")])  # (2, r, in)
        b_stack = jnp.stack([ours[n][path].factors["b"].T for n in ("t1", "t2")])  # (2, out, r)
        if combination == "ties":
            a_m = ties_delta(a_stack, density=density, weights=root * np.sign(weights))
            b_m = ties_delta(b_stack, density=density, weights=root)
        else:
            a_m = jnp.tensordot(jnp.asarray(root * np.sign(weights)), a_stack, 1)
            b_m = jnp.tensordot(jnp.asarray(root), b_stack, 1)
        want = np.asarray(b_m @ a_m).T  # PEFT's merged product, reproduced with our steps
        np.testing.assert_allclose(want, _peft_delta(model, "m", layer), atol=2e-5)
        if combination == "linear":
            # versus the product merge: the factor-wise one adds the cross terms B_i A_j, i != j
            ours_ta = merging.merge_task_arithmetic([ours["t1"], ours["t2"]], weights=weights)
            ta = np.asarray(adapters.delta(ours_ta[path], shape))
            fa, fb = (np.asarray(ours[n][path].factors["a"]) for n in ("t1", "t2"))
            ga, gb = (np.asarray(ours[n][path].factors["b"]) for n in ("t1", "t2"))
            cross = root[0] * root[1] * np.sign(weights[1]) * fb @ ga
            cross += root[0] * root[1] * np.sign(weights[0]) * fa @ gb
            np.testing.assert_allclose(want - ta, cross, atol=5e-5)
            assert np.linalg.norm(cross) > 0.1 * np.linalg.norm(ta)


# ------------------------------------------------------------------------------------------------
# add_weighted_adapter: PEFT's combination types on products (#32 item 3).


def _ours_delta(merged, layer):
    return np.asarray(adapters.delta(merged[f"{layer}/kernel"], DIMS[layer]))


@pytest.mark.parametrize("combination", ["svd", "cat", "ties_svd", "magnitude_prune_svd"])
def test_add_weighted_adapter_equals_peft_where_peft_merges_products(combination):
    model, ours = _setup(seed=4)
    weights, density = [1.0, -0.6], 0.5
    kwargs = {} if combination in ("svd", "cat") else {"density": density}
    model.add_weighted_adapter(["t1", "t2"], weights, "m", combination_type=combination, **kwargs)
    merged = merging.add_weighted_adapter(
        [ours["t1"], ours["t2"]], weights, combination_type=combination, **kwargs
    )
    want_rank = 2 * RANK if combination == "cat" else RANK  # PEFT: sum of ranks / the max rank
    for layer in DIMS:
        assert merged[f"{layer}/kernel"].kind.rank == want_rank
        np.testing.assert_allclose(
            _ours_delta(merged, layer), _peft_delta(model, "m", layer), atol=2e-5
        )


def test_add_weighted_adapter_linear_of_one_adapter_equals_peft():
    model, ours = _setup(seed=5)
    model.add_weighted_adapter(["t1"], [-0.7], "m", combination_type="linear")  # exact for K=1
    merged = merging.add_weighted_adapter([ours["t1"]], [-0.7], combination_type="linear")
    for layer in DIMS:
        np.testing.assert_allclose(
            _ours_delta(merged, layer), _peft_delta(model, "m", layer), atol=2e-5
        )


def test_linear_with_negative_weights_is_exact_where_peft_is_not():
    """PEFT #3004: PEFT's ``linear`` merges A and B apart (cross terms); ours is Σ w_k ΔW_k."""
    model, ours = _setup(seed=6)
    weights = [0.8, -1.3]
    model.add_weighted_adapter(["t1", "t2"], weights, "m", combination_type="linear")
    merged = merging.add_weighted_adapter(
        [ours["t1"], ours["t2"]], weights, combination_type="linear"
    )
    for layer in DIMS:
        path = f"{layer}/kernel"
        want = sum(  # float64 reference
            w
            * (ALPHA / RANK)
            * np.asarray(ours[n][path].factors["a"], np.float64)
            @ np.asarray(ours[n][path].factors["b"], np.float64)
            for w, n in zip(weights, ("t1", "t2"), strict=True)
        )
        got = _ours_delta(merged, layer)
        assert np.abs(got - want).max() <= 1e-6 * max(1.0, np.abs(want).max())
        assert merged[path].kind.rank == min(2 * RANK, *DIMS[layer])  # exact: the stacked rank
        peft_error = np.abs(_peft_delta(model, "m", layer) - want).max()
        assert peft_error > 0.1 * np.abs(want).max()


def test_dare_ties_equals_peft_dare_ties_svd_with_its_masks(monkeypatch):
    model, ours = _setup(seed=7)
    drawn = []
    bernoulli = torch.bernoulli

    def record(p, *args, **kwargs):
        mask = bernoulli(p, *args, **kwargs)
        drawn.append(mask.numpy().T.astype(bool))
        return mask

    monkeypatch.setattr(torch, "bernoulli", record)
    weights, density, rank = [0.9, -0.4], 0.6, 2
    torch.manual_seed(0)
    model.add_weighted_adapter(
        ["t1", "t2"], weights, "m", combination_type="dare_ties_svd", density=density,
        svd_rank=rank,
    )  # fmt: skip
    views = task_vector_matrices([ours["t1"], ours["t2"]])
    for i, layer in enumerate(DIMS):
        deltas = views[f"{layer}/kernel"][0][:, 0]
        keep = jnp.asarray(np.stack(drawn[2 * i : 2 * i + 2]))
        merged = dare_ties_delta(deltas, keep, density=density, weights=weights)
        a, b = balanced_factors(merged, rank=rank)
        np.testing.assert_allclose(np.asarray(a @ b), _peft_delta(model, "m", layer), atol=2e-5)


def _per_kernel_rule(base, deltas, masks, density, weights):
    if base == "ties":
        return ties_delta(deltas, density=density, weights=weights)
    if base == "magnitude_prune":
        return magnitude_prune_delta(deltas, density=density, weights=weights)
    if base == "dare_linear":
        return dare_delta(deltas, masks, density=density, weights=weights)
    return dare_ties_delta(deltas, masks, density=density, weights=weights)


@pytest.mark.parametrize(
    "combination",
    ["ties", "dare_linear", "dare_ties", "magnitude_prune", "dare_linear_svd", "dare_ties_svd"],
)
def test_add_weighted_adapter_types_follow_their_per_kernel_rule(combination):
    _, ours = _setup(seed=8)
    weights, density, key = [1.0, 0.5], 0.5, jax.random.key(3)
    merged = merging.add_weighted_adapter(
        [ours["t1"], ours["t2"]], weights, combination_type=combination, density=density, key=key
    )
    views = task_vector_matrices([ours["t1"], ours["t2"]])
    for i, (layer, (n, m)) in enumerate(DIMS.items()):
        deltas = views[f"{layer}/kernel"][0][:, 0]
        masks = dare_masks(
            jax.random.fold_in(jax.random.fold_in(key, i), 0), deltas.shape, density=density
        )
        base = combination.removesuffix("_svd")
        expected = np.asarray(_per_kernel_rule(base, deltas, masks, density, weights))
        if combination.endswith("_svd"):  # truncated to the adapters' rank
            a, b = balanced_factors(jnp.asarray(expected), rank=RANK)
            expected = np.asarray(a @ b)
            assert merged[f"{layer}/kernel"].kind.rank == RANK
        else:  # exact
            assert merged[f"{layer}/kernel"].kind.rank == min(n, m)
        np.testing.assert_allclose(_ours_delta(merged, layer), expected, atol=1e-5)


def _random_lora_set(params, ranks, seed):
    rules = [(f"{p}", adapters.lora(rank=r, alpha=2.0 * r)) for p, r in ranks.items()]
    ads = adapters.init(jax.random.key(seed), params, rules)
    rng = np.random.default_rng(seed)
    return {
        p: a.replace(
            factors={
                k: jnp.asarray(rng.normal(size=f.shape), jnp.float32) for k, f in a.factors.items()
            }
        )
        for p, a in ads.items()
    }


@pytest.mark.parametrize("combination", ["linear", "svd", "ties", "dare_linear", "magnitude_prune"])
def test_merge_with_per_module_ranks_reloads(tmp_path, combination):
    """PEFT #3737: its merge of adapters with a rank_pattern cannot be reloaded; ours can."""
    params = {n: {"kernel": jnp.zeros(d)} for n, d in DIMS.items()}
    first = _random_lora_set(params, {"l0/kernel": 1, "l1/kernel": 4}, seed=1)
    second = _random_lora_set(params, {"l0/kernel": 2, "l1/kernel": 4}, seed=2)  # another l0 rank
    merged = merging.add_weighted_adapter(
        [first, second], [1.0, -0.5], combination_type=combination, density=0.5,
        key=jax.random.key(0),
    )  # fmt: skip
    ranks = {p: a.kind.rank for p, a in merged.items()}
    assert len(set(ranks.values())) == 2  # per-module ranks
    if combination == "svd":
        assert ranks == {"l0/kernel": 2, "l1/kernel": 4}  # the largest rank at each kernel
    names = {"l0/kernel": "l0", "l1/kernel": "l1"}
    adapters.save_peft(tmp_path, merged, module_name=names.__getitem__)
    back = adapters.load_peft(tmp_path, params, module_path=lambda n: f"{n}/kernel")
    peft_model = peft.PeftModel.from_pretrained(_Net(), str(tmp_path))  # and PEFT loads it
    for layer, shape in DIMS.items():
        path = f"{layer}/kernel"
        want = np.asarray(adapters.delta(merged[path], shape))
        np.testing.assert_allclose(np.asarray(adapters.delta(back[path], shape)), want, atol=1e-6)
        np.testing.assert_allclose(_peft_delta(peft_model, "default", layer), want, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "in_ndim"), [((3, 4, 5), 2), ((2, 2, 2, 3, 4), 4)], ids=["conv1d", "conv3d"]
)
@pytest.mark.parametrize("combination", ["svd", "ties_svd", "magnitude_prune_svd", "cat"])
def test_svd_merges_work_on_conv_kernels(shape, in_ndim, combination):
    """PEFT #3769: its SVD merges fail on Conv1d/Conv3d; ours merge the (n, m) matrix view."""
    params = {"conv": {"kernel": jnp.zeros(shape)}}
    spec = adapters.lora(rank=2, alpha=4.0, in_ndim=in_ndim, out_ndim=1)
    rng = np.random.default_rng(0)
    sets = []
    for seed in range(2):
        ads = adapters.init(jax.random.key(seed), params, [(r".*kernel", spec)])
        sets.append(
            {p: a.replace(factors={k: jnp.asarray(rng.normal(size=f.shape), jnp.float32)
                                   for k, f in a.factors.items()}) for p, a in ads.items()}
        )  # fmt: skip
    weights = [0.7, -1.1]
    merged = merging.add_weighted_adapter(
        sets, weights, combination_type=combination, density=0.5, svd_rank=2
    )
    n, m = int(np.prod(shape[:-1])), shape[-1]
    deltas = jnp.stack([adapters.delta(s["conv/kernel"], shape).reshape(n, m) for s in sets])
    exact = {
        "svd": lambda: jnp.tensordot(jnp.asarray(weights), deltas, 1),
        "cat": lambda: jnp.tensordot(jnp.asarray(weights), deltas, 1),
        "ties_svd": lambda: ties_delta(deltas, density=0.5, weights=weights),
        "magnitude_prune_svd": lambda: magnitude_prune_delta(deltas, density=0.5, weights=weights),
    }[combination]()
    if combination != "cat":
        a, b = balanced_factors(exact, rank=2)
        exact = a @ b
    got = adapters.delta(merged["conv/kernel"], shape)
    np.testing.assert_allclose(np.asarray(got).reshape(n, m), np.asarray(exact), atol=1e-5)
    merged_params = adapters.fold(params, merged)  # folds into the conv kernel
    assert merged_params["conv"]["kernel"].shape == shape


def test_add_weighted_adapter_rejects_bad_input():
    _, ours = _setup()
    sets = [ours["t1"], ours["t2"]]
    with pytest.raises(ValueError, match="combination_type must be one of"):
        merging.add_weighted_adapter(sets, [1, 1], combination_type="mean")
    with pytest.raises(ValueError, match="needs density"):
        merging.add_weighted_adapter(sets, [1, 1], combination_type="ties")
    with pytest.raises(ValueError, match="needs a PRNG key"):
        merging.add_weighted_adapter(sets, [1, 1], combination_type="dare_linear", density=0.5)
    with pytest.raises(ValueError, match="one weight per adapter"):
        merging.add_weighted_adapter(sets, [1.0], combination_type="svd")
    assert len(merging.COMBINATION_TYPES) == 11
