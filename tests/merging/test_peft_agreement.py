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
    views = merging.task_vector_matrices([ours["t1"], ours["t2"]])
    for i, layer in enumerate(DIMS):
        deltas = views[f"{layer}/kernel"][0][:, 0]  # (2, n, m)
        keep = jnp.asarray(np.stack(drawn[2 * i : 2 * i + 2]))
        merged = merging.dare_delta(deltas, keep, density=density, weights=weights)
        a, b = merging.lowrank_factors(merged, rank=rank)
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
            a_m = merging.ties_delta(a_stack, density=density, weights=root * np.sign(weights))
            b_m = merging.ties_delta(b_stack, density=density, weights=root)
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
