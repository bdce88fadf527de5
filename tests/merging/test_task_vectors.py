"""Task arithmetic, TIES and DARE on adapter products against float64 NumPy definitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters, merging
from lowrank_jax.merging.sparsify import dare_delta, dare_masks, ties_delta
from lowrank_jax.merging.task_merges import trim_task_vectors

PARAMS = {
    "l1": {"kernel": jnp.zeros((6, 5))},
    "stack": {"kernel": jnp.zeros((3, 4, 6))},  # 3 stacked (4, 6) layers
}
RULES = [
    (r"l1/kernel", adapters.lora(rank=2, alpha=4.0)),
    (r"stack/kernel", adapters.lora(rank=2, in_ndim=1, out_ndim=1)),
]


def random_lora(seed: int) -> dict:
    """A LoRA set with random (nonzero) A and B."""
    ads = adapters.init(jax.random.key(seed), PARAMS, RULES)
    key = jax.random.key(100 + seed)
    out = {}
    for i, (path, ad) in enumerate(ads.items()):
        b = jax.random.normal(jax.random.fold_in(key, i), ad.factors["b"].shape)
        out[path] = ad.replace(factors={**ad.factors, "b": b})
    return out


def products(ads: dict) -> dict[str, np.ndarray]:
    """{path: (L, n, m) float64 ΔW = s A B} computed in NumPy."""
    out = {}
    for path, ad in ads.items():
        a = np.asarray(ad.factors["a"], np.float64)
        b = np.asarray(ad.factors["b"], np.float64)
        n, m = ad.matrix
        out[path] = (ad.kind.scale * a @ b).reshape(-1, n, m)
    return out


def ties_reference(deltas, density, weights, majority="total"):
    """TIES step by step in float64: trim, elect, disjoint mean (PEFT's conventions)."""
    deltas = np.asarray(deltas, np.float64)
    trimmed = []
    for d in deltas:
        flat = d.reshape(-1)
        k = int(density * flat.size)
        keep = np.zeros(flat.size, bool)
        keep[np.argsort(-np.abs(flat), kind="stable")[:k]] = True
        trimmed.append(np.where(keep, flat, 0.0).reshape(d.shape))
    trimmed = np.stack(trimmed)
    if majority == "total":
        elected = np.where(trimmed.sum(0) >= 0, 1.0, -1.0)
    else:
        elected = np.where(np.sign(trimmed).sum(0) >= 0, 1.0, -1.0)
    agree = np.sign(trimmed) == elected
    w = np.asarray(weights, np.float64)[:, None, None]
    return (w * trimmed * agree).sum(0) / np.maximum(agree.sum(0), 1)


@pytest.mark.parametrize("majority", ["total", "frequency"])
@pytest.mark.parametrize("density", [0.3, 0.5, 1.0])
def test_ties_follows_its_definition(majority, density):
    rng = np.random.default_rng(0)
    deltas = rng.normal(size=(3, 7, 9))
    weights = (1.0, 0.5, 2.0)
    got = ties_delta(
        jnp.asarray(deltas, jnp.float32), density=density, weights=weights, majority=majority
    )
    want = ties_reference(deltas, density, weights, majority)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def ties_global_reference(task_vectors, density, weights, majority="total"):
    """The TIES paper's merge in float64: each task vector ``{path: array}`` is trimmed as a whole
    (one magnitude ranking over all its entries), then sign election and disjoint mean."""
    paths = sorted(task_vectors[0])
    flat = np.stack([np.concatenate([tv[p].ravel() for p in paths]) for tv in task_vectors])
    k = int(density * flat.shape[1])
    trimmed = np.zeros_like(flat)
    for i, f in enumerate(flat):
        keep = np.argsort(-np.abs(f), kind="stable")[:k]
        trimmed[i, keep] = f[keep]
    merged = ties_reference(trimmed[:, None, :], 1.0, weights, majority)[0]
    out, start = {}, 0
    for p in paths:
        size = task_vectors[0][p].size
        out[p] = merged[start : start + size].reshape(task_vectors[0][p].shape)
        start += size
    return out


def _dense_task_vectors(seed, k=3):
    """``k`` dense task vectors over two kernels whose updates differ in scale by 4x."""
    rng = np.random.default_rng(seed)
    return [
        {"big/kernel": 2.0 * rng.normal(size=(8, 6)), "small/kernel": 0.5 * rng.normal(size=(5, 7))}
        for _ in range(k)
    ]


@pytest.mark.parametrize("majority", ["total", "frequency"])
@pytest.mark.parametrize("density", [0.2, 0.5])
def test_merge_ties_trims_the_whole_task_vector_as_the_paper(majority, density):
    tvs = _dense_task_vectors(0)
    weights = (1.0, 0.5, 2.0)
    as32 = [{p: jnp.asarray(x, jnp.float32) for p, x in tv.items()} for tv in tvs]
    merged = merging.merge_ties(as32, density=density, weights=weights, majority=majority)
    want = ties_global_reference(tvs, density, weights, majority)
    per_kernel = merging.merge_ties(
        as32, density=density, weights=weights, majority=majority, trim="per_kernel"
    )
    gap, norm = 0.0, 0.0
    for path, ad in merged.items():
        got = np.asarray(adapters.delta(ad, want[path].shape), np.float64)
        np.testing.assert_allclose(got, want[path], atol=2e-5)
        # per-kernel trimming (PEFT's) is the per-matrix definition, and a different merge
        per = np.asarray(adapters.delta(per_kernel[path], want[path].shape), np.float64)
        ref = ties_reference(np.stack([tv[path] for tv in tvs]), density, weights, majority)
        np.testing.assert_allclose(per, ref, atol=2e-5)
        gap, norm = gap + np.sum((per - got) ** 2), norm + np.sum(got**2)
    # globally the large kernel keeps more than `density` of its entries, the small one fewer
    assert np.sqrt(gap / norm) > 0.2


def test_trim_task_vectors_keeps_the_stated_counts():
    tvs = [{p: jnp.asarray(x, jnp.float32) for p, x in tv.items()} for tv in _dense_task_vectors(1)]
    total = sum(x.size for x in tvs[0].values())
    glob = trim_task_vectors(tvs, density=0.3)
    per = trim_task_vectors(tvs, density=0.3, trim="per_kernel")
    for k in range(3):
        kept = sum(int(jnp.sum(v[k] != 0)) for v in glob.values())
        assert kept == int(0.3 * total)
        # globally, every kept entry is at least as large as every dropped one of the same task
        kept_mags, dropped_mags = [], []
        for path, v in glob.items():
            keep = np.asarray(v[k, 0]) != 0  # (K, L, n, m) views, L = 1
            mag = np.abs(np.asarray(tvs[k][path]))
            kept_mags.extend(mag[keep].tolist())
            dropped_mags.extend(mag[~keep].tolist())
        smallest_kept, largest_dropped = min(kept_mags), max(dropped_mags)
        assert smallest_kept >= largest_dropped
        for path, v in per.items():
            assert int(jnp.sum(v[k] != 0)) == int(0.3 * tvs[k][path].size)
    # the large kernel takes more than its share globally
    assert int(jnp.sum(glob["big/kernel"] != 0)) > int(jnp.sum(per["big/kernel"] != 0))
    with pytest.raises(ValueError, match="trim"):
        trim_task_vectors(tvs, density=0.3, trim="per_layer")


def test_ties_steps_are_visible():
    # two tasks, opposite signs at one entry: the larger mass wins and is kept alone there
    d = np.zeros((2, 2, 2))
    d[0, 0, 0], d[1, 0, 0] = 3.0, -1.0  # elected +: mean of agreeing = 3
    d[0, 1, 1], d[1, 1, 1] = 2.0, 4.0  # both +: disjoint mean 3
    d[0, 0, 1] = 0.1  # trimmed away at density 0.5 (keeps 2 of 4 per task)
    got = np.asarray(ties_delta(jnp.asarray(d, jnp.float32), density=0.5))
    np.testing.assert_allclose(got, [[3.0, 0.0], [0.0, 3.0]], atol=1e-7)


def test_dare_follows_its_definition_with_injected_masks():
    rng = np.random.default_rng(1)
    deltas = rng.normal(size=(2, 5, 6))
    keep = rng.random(size=deltas.shape) < 0.4
    got = dare_delta(
        jnp.asarray(deltas, jnp.float32), jnp.asarray(keep), density=0.4, weights=(1.0, -0.5)
    )
    want = (np.array([1.0, -0.5])[:, None, None] * np.where(keep, deltas, 0) / 0.4).sum(0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_dare_is_unbiased_and_keeps_density():
    rng = np.random.default_rng(2)
    deltas = jnp.asarray(rng.normal(size=(2, 4, 5)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4000)
    masks = jax.vmap(lambda k: dare_masks(k, deltas.shape, density=0.3))(keys)
    merged = jax.vmap(lambda mk: dare_delta(deltas, mk, density=0.3))(masks)
    np.testing.assert_allclose(float(masks.mean()), 0.3, atol=0.005)
    # E[merge] = Σ Δ_k; per-entry std of the mean <= sqrt((1-p)/p) |Δ| sqrt(2) / sqrt(4000)
    stderr = np.sqrt(0.7 / 0.3 * 2 / 4000) * float(jnp.max(jnp.abs(deltas)))
    np.testing.assert_allclose(merged.mean(0), deltas.sum(0), atol=5 * stderr)


def test_merging_lora_products_equals_merging_dense_deltas():
    sets = [random_lora(0), random_lora(1)]
    # regroup into two dense task vectors
    dense = [{p: adapters.delta(ad, _kernel_shape(p)) for p, ad in s.items()} for s in sets]
    del dense[0]["stack/kernel"], dense[1]["stack/kernel"]  # dense stacked needs an Adapter
    lora_only = [{"l1/kernel": s["l1/kernel"]} for s in sets]
    for merge, kw in (
        (merging.merge_task_arithmetic, {}),
        (merging.merge_ties, {"density": 0.4}),
        (merging.merge_dare, {"density": 0.6}),
    ):
        args = (jax.random.key(3),) if merge is merging.merge_dare else ()
        from_lora = merge(lora_only, *args, weights=(0.7, 1.3), **kw)
        from_dense = merge(dense, *args, weights=(0.7, 1.3), **kw)
        for p in from_lora:
            np.testing.assert_allclose(
                np.asarray(adapters.delta(from_lora[p], _kernel_shape(p))),
                np.asarray(adapters.delta(from_dense[p], _kernel_shape(p))),
                atol=1e-5,
            )
    # a dense stacked update takes its layout from an Adapter at the same path
    mixed = [
        sets[0],
        {**dense[1], "stack/kernel": adapters.delta(sets[1]["stack/kernel"], (3, 4, 6))},
    ]
    a = merging.merge_ties(sets, density=0.5)
    b = merging.merge_ties(mixed, density=0.5)
    np.testing.assert_allclose(
        np.asarray(adapters.delta(a["stack/kernel"], (3, 4, 6))),
        np.asarray(adapters.delta(b["stack/kernel"], (3, 4, 6))),
        atol=1e-5,
    )


def _kernel_shape(path: str) -> tuple[int, ...]:
    return PARAMS[path.split("/")[0]]["kernel"].shape


@pytest.mark.parametrize("rank", [None, 3])
def test_task_arithmetic_is_the_truncated_svd_of_the_weighted_sum(rank):
    sets = [random_lora(0), random_lora(1), random_lora(2)]
    weights = (1.0, -0.5, 0.25)
    merged = merging.merge_task_arithmetic(sets, weights=weights, rank=rank)
    ref = [products(s) for s in sets]
    for path, ad in merged.items():
        total = sum(w * r[path] for w, r in zip(weights, ref, strict=True))
        n, m = ad.matrix
        want_rank = min(6, n, m) if rank is None else rank  # stacked rank 3 x 2 = 6
        assert ad.kind.rank == want_rank and ad.kind.scale == 1.0
        got = np.asarray(adapters.delta(ad, _kernel_shape(path)), np.float64).reshape(-1, n, m)
        for g, t in zip(got, total, strict=True):
            u, s, vt = np.linalg.svd(t)
            r = min(want_rank, len(s))
            best = (u[:, :r] * s[:r]) @ vt[:r]
            np.testing.assert_allclose(g, best, atol=2e-5)
            if rank is not None:
                assert np.linalg.matrix_rank(g, tol=1e-5) == min(rank, np.linalg.matrix_rank(t))


def test_ties_output_has_stated_rank_and_is_best_approximation():
    sets = [random_lora(0), random_lora(1)]
    merged = merging.merge_ties(sets, density=0.5, rank=2)
    full = merging.merge_ties(sets, density=0.5, rank=None)
    for path in merged:
        shape = _kernel_shape(path)
        n, m = merged[path].matrix
        got = np.asarray(adapters.delta(merged[path], shape), np.float64).reshape(-1, n, m)
        exact = np.asarray(adapters.delta(full[path], shape), np.float64).reshape(-1, n, m)
        for g, e in zip(got, exact, strict=True):
            assert np.linalg.matrix_rank(g, tol=1e-5) == 2
            u, s, vt = np.linalg.svd(e)
            np.testing.assert_allclose(g, (u[:, :2] * s[:2]) @ vt[:2], atol=2e-5)


def test_relative_to_subtracts_an_update_before_factorising():
    sets = [random_lora(0), random_lora(1)]
    tau0 = {p: adapters.delta(ad, _kernel_shape(p)) for p, ad in random_lora(5).items()}
    tau0["stack/kernel"] = random_lora(5)["stack/kernel"]
    merged = merging.merge_task_arithmetic(sets, relative_to=tau0)
    ref = [products(s) for s in sets]
    for path, ad in merged.items():
        n, m = ad.matrix
        got = np.asarray(adapters.delta(ad, _kernel_shape(path)), np.float64).reshape(-1, n, m)
        want = ref[0][path] + ref[1][path] - products(random_lora(5))[path]
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_task_vector_of_parameter_trees():
    base = {"a": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}}
    ft = {"a": {"kernel": 2 * jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
    tv = merging.task_vector(ft, base)
    assert set(tv) == {"a/kernel"}
    np.testing.assert_allclose(np.asarray(tv["a/kernel"]), np.ones((3, 2)))


def _first_path_error(fn, path):
    with pytest.raises(ValueError, match=path):
        fn()


def test_every_merge_rejects_mismatched_trees_naming_the_first_differing_path():
    a, b = random_lora(0), random_lora(1)
    b_missing = {k: v for k, v in b.items() if k != "l1/kernel"}
    for fn in (
        lambda: merging.merge_task_arithmetic([a, b_missing]),
        lambda: merging.merge_ties([a, b_missing], density=0.5),
        lambda: merging.merge_dare([a, b_missing], jax.random.key(0), density=0.5),
        lambda: merging.merge_task_arithmetic([a, b], relative_to=b_missing),
    ):
        _first_path_error(fn, "'l1/kernel'")
    # same paths, different shapes
    wrong = {**b, "l1/kernel": jnp.zeros((5, 5))}
    _first_path_error(lambda: merging.merge_ties([a, wrong], density=0.5), "'l1/kernel'")
    base = {"a": {"kernel": jnp.ones((3, 2))}, "b": {"kernel": jnp.ones((2, 2))}}
    _first_path_error(
        lambda: merging.task_vector({"a": base["a"], "c": base["b"]}, base), "'b/kernel'"
    )
    with pytest.raises(ValueError, match="density"):
        merging.merge_ties([a, b], density=0.0)
    with pytest.raises(ValueError, match="rank"):
        merging.merge_ties([a, b], density=0.5, rank=5)
    with pytest.raises(TypeError):
        merging.merge_ties(a, density=0.5)


def _dora_sets(k=3, stacked=True):
    """``k`` DoRA sets with moved directions and magnitudes over random base kernels (one
    stacked), and their dense updates ``{path: ΔW}``."""
    params = {"l1": {"kernel": jax.random.normal(jax.random.key(7), (6, 5))}}
    rules = [(r"l1/kernel", adapters.dora(2, alpha=4.0))]
    if stacked:
        params["stack"] = {"kernel": jax.random.normal(jax.random.key(8), (3, 4, 6))}
        rules.append((r"stack/kernel", adapters.dora(2, in_ndim=1, out_ndim=1)))
    sets, dense = [], []
    for seed in range(k):
        ads = adapters.init(jax.random.key(seed), params, rules)
        noise = jax.random.key(50 + seed)
        ads = jax.tree.map(lambda x, k=noise: x + 0.3 * jax.random.normal(k, x.shape), ads)
        sets.append(ads)
        kernels = {p: params[p.split("/")[0]]["kernel"] for p in ads}
        dense.append({p: adapters.delta(ad, kernels[p].shape, kernels[p]) for p, ad in ads.items()})
    return params, sets, dense


def _shape(params, path):
    return params[path.split("/")[0]]["kernel"].shape


def test_dora_sets_merge_through_their_dense_updates():
    params, sets, dense = _dora_sets()
    weights = (0.5, -1.0, 2.0)
    merged = merging.merge_task_arithmetic(sets, weights=weights, base=params)
    for path, ad in merged.items():
        want = sum(w * np.asarray(d[path], np.float64) for w, d in zip(weights, dense, strict=True))
        got = adapters.delta(ad, _shape(params, path))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_every_rule_merges_dora_sets_as_their_dense_updates():
    params, sets, dense = _dora_sets(stacked=False)  # dense 3-D updates would need a layout
    pairs = [
        (
            merging.merge_ties(sets, density=0.4, rank=2, base=params),
            merging.merge_ties(dense, density=0.4, rank=2),
        ),
        (
            merging.merge_dare(sets, jax.random.key(3), density=0.5, base=params),
            merging.merge_dare(dense, jax.random.key(3), density=0.5),
        ),
    ]
    for got, want in pairs:
        for path in got:
            np.testing.assert_allclose(
                adapters.delta(got[path], _shape(params, path)),
                adapters.delta(want[path], _shape(params, path)),
                rtol=1e-5,
                atol=1e-6,
            )
