"""P13 prompt methods on a tiny frozen multimodal transformer: identities, masks, gradients,
and input conditioning (DCP-like and SPR read the input; MAP and MSP do not)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.metrics import f1_score

from lowrank_jax import prompts as P
from lowrank_jax.prompts.methods import dcp_prompts, map_prompts, modality_prompts, no_prompts
from lowrank_jax.prompts.missing import num_missing_types, sample_missing
from lowrank_jax.prompts.training import macro_f1, prompted_logits, split_head

DIM, DEPTH, B = 16, 3, 6
MODALITIES = ("img", "txt")


@pytest.fixture(scope="module")
def setup():
    model = P.MultimodalTransformer(
        MODALITIES, (7, 5), (3, 2), dim=DIM, depth=DEPTH, heads=2, mlp_dim=32, num_classes=4
    )
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    feats = {"img": jax.random.normal(k1, (B, 7)), "txt": jax.random.normal(k2, (B, 5))}
    params = jax.jit(model.init)(k3, feats)["params"]
    return model, feats, params


KW = dict(num_modalities=2, num_layers=2, num_tokens=4, dim=DIM)
# The modality features of B inputs, rows repeating with period 3 (as PATTERNS["mixed"] does).
CONTEXT = jnp.tile(jax.random.normal(jax.random.key(11), (3, 2, DIM)), (B // 3, 1, 1))


def _shifted(params, scale=0.1):
    """Every leaf moved by random noise (a trained-looking state: zero-initialised output layers
    become non-zero, so every module acts)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(tree, noisy)


@pytest.fixture(scope="module")
def methods():
    """The four prompt methods with their initial parameters (initialised once)."""
    ms = [
        map_prompts(**KW),
        modality_prompts(**KW),
        dcp_prompts(**KW, bottleneck=4),
        P.spr_prompts(**KW, hidden=8),
    ]
    return {m.name: (m, m.init(jax.random.key(i))) for i, m in enumerate(ms)}


PATTERNS = {
    "complete": [[False, False]] * B,
    "img-missing": [[True, False]] * B,
    "txt-missing": [[False, True]] * B,
    "mixed": [[False, False], [True, False], [False, True]] * (B // 3),
}


def test_disabled_prompts_and_probe_equal_the_frozen_model(setup, methods):
    model, feats, params = setup
    apply = jax.jit(model.apply)
    frozen_logits = apply({"params": params}, feats)
    complete = jnp.zeros((B, 2), bool)
    frozen, head = split_head(params)
    probe = no_prompts(num_modalities=2)
    got = prompted_logits(model, frozen, {"prompts": {}, "head": head}, probe, feats, complete)
    np.testing.assert_allclose(got, frozen_logits, rtol=0, atol=1e-6)
    # Any prompts, with every slot switched off, leave the frozen model's output unchanged.
    p = jax.random.normal(jax.random.key(1), (B, 2, 4, DIM))
    off = jnp.zeros((B, 4), bool)
    out = apply({"params": params}, feats, complete, prompts=p, prompt_mask=off)
    np.testing.assert_allclose(out, frozen_logits, rtol=0, atol=1e-5)
    on = apply({"params": params}, feats, complete, prompts=p, prompt_mask=off.at[:, 1].set(True))
    assert np.abs(on - frozen_logits).max() > 1e-3  # one active slot matters
    # MSP's groups stand in for missing modalities: a complete example sees none of them.
    msp, pp = methods["msp"]
    got = prompted_logits(model, frozen, {"prompts": pp, "head": head}, msp, feats, complete)
    np.testing.assert_allclose(got, frozen_logits, rtol=0, atol=1e-5)


def _np_frozen(params, feats, keep, *, blank=False):
    """float64 NumPy forward of the backbone: without ``blank``, on the kept modalities only
    (the others' tokens removed); with ``blank``, every modality's tokens, the others' features
    replaced by zeros."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)

    def ln(x, q):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-6) * q["scale"] + q["bias"]

    def dense(x, q):
        return x @ q["kernel"] + q["bias"]

    b = feats["img"].shape[0]
    parts, pos, start = [np.broadcast_to(p["cls_token"], (b, 1, DIM))], [0], 1
    for i, (name, t) in enumerate(zip(MODALITIES, (3, 2), strict=True)):
        if keep[i] or blank:
            x = np.asarray(feats[name], np.float64) * keep[i]
            parts.append(dense(x, p[f"proj_{i}"]).reshape(b, t, DIM))
            pos += list(range(start, start + t))
        start += t
    x = np.concatenate(parts, 1) + p["pos_embed"][:, pos]
    h, k = 2, DIM // 2
    for layer in range(DEPTH):
        q = p[f"layers_{layer}"]
        y = ln(x, q["ln_attention"])
        a = q["attention"]
        split = lambda z: z.reshape(b, -1, h, k)  # noqa: E731
        qq, kk, vv = (split(dense(y, a[n])) for n in ("query", "key", "value"))
        s = np.einsum("bqhk,bshk->bhqs", qq, kk) / np.sqrt(k)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        x = x + dense(np.einsum("bhqs,bshk->bqhk", w, vv).reshape(b, -1, DIM), a["out"])
        y = ln(x, q["ln_mlp"])
        gelu = jax.nn.gelu(jnp.asarray(dense(y, q["mlp"]["fc1"]), jnp.float32))
        x = x + dense(np.asarray(gelu, np.float64), q["mlp"]["fc2"])
    return dense(ln(x, p["ln_final"])[:, 0], p["head"])


@pytest.mark.parametrize("mode", ["blank", "drop"])
def test_missing_modality_is_a_blank_input_or_dropped_tokens_float64(setup, mode):
    """blank (the default): zero features, tokens attended to; drop: tokens removed."""
    model, feats, params = setup
    assert model.missing_input == "blank"
    apply = jax.jit(model.clone(missing_input=mode).apply)
    for name in ("complete", "img-missing", "txt-missing"):
        missing = jnp.array(PATTERNS[name])
        got = apply({"params": params}, feats, missing)
        keep = ~np.asarray(missing[0])
        want = _np_frozen(params, feats, keep, blank=mode == "blank")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)
        # The values of a missing modality's features are never read.
        noisy = {k: v + 100.0 * missing[:, i : i + 1] for i, (k, v) in enumerate(feats.items())}
        np.testing.assert_allclose(apply({"params": params}, noisy, missing), got, atol=1e-6)


def test_blank_input_shifts_the_frozen_output_where_drop_does_not_see_it(setup):
    """Same parameters: the modes agree on complete examples and differ on a missing modality
    (the blank tokens are attended to), and the blank tokens are the projection biases."""
    model, feats, params = setup
    blank, drop = jax.jit(model.apply), jax.jit(model.clone(missing_input="drop").apply)
    for name, pattern in PATTERNS.items():
        missing = jnp.array(pattern)
        a, d = blank({"params": params}, feats, missing), drop({"params": params}, feats, missing)
        complete = ~np.asarray(missing).any(1)
        np.testing.assert_allclose(a[complete], d[complete], atol=1e-6, err_msg=name)
        if (~complete).any():
            assert np.abs(a[~complete] - d[~complete]).max() > 1e-3, name
    x, mask = model.apply({"params": params}, feats, jnp.array(PATTERNS["img-missing"]),
                          method="embed")  # fmt: skip
    assert bool(mask.all())
    bias = params["proj_0"]["bias"].reshape(3, DIM) + params["pos_embed"][0, 1:4]
    np.testing.assert_allclose(x[:, 1:4], np.broadcast_to(bias, (B, 3, DIM)), atol=1e-6)


def test_shapes_masks_and_type_gather_for_every_pattern(methods):
    missing = jnp.array(PATTERNS["mixed"])
    types = np.asarray(P.missing_type(missing))
    np.testing.assert_array_equal(types, [0, 1, 2] * (B // 3))
    for name, (method, pp) in methods.items():
        assert method.conditioned == (name in ("dcp", "spr")), name
        pp = _shifted(pp)  # every module acting (at init DCP's and SPR's input terms are zero)
        p, mask = jax.jit(method.prompts)(pp, missing, CONTEXT)
        tokens = 8 if name == "msp" else 4
        assert p.shape == (B, 2, tokens, DIM) and mask.shape == (B, tokens), name
        if name == "msp":  # group i (4 slots) on where modality i is missing
            np.testing.assert_array_equal(mask, np.repeat(np.asarray(missing), 4, 1))
            np.testing.assert_array_equal(p[0, :, :4], pp["prompts"][0])
            np.testing.assert_array_equal(p[0, :, 4:], pp["prompts"][1])
        else:
            assert bool(mask.all()), name
        # Examples of one missing type and one input get the same prompts; the types differ.
        np.testing.assert_allclose(p[:3], p[3:], rtol=0, atol=1e-6)
        assert (name == "msp") == bool(jnp.all(p[0] == p[1]))
    mp, pp = methods["map"]
    p, _ = mp.prompts(pp, missing)
    np.testing.assert_array_equal(p, pp["prompts"][types])


def test_dcp_and_spr_prompts_depend_on_the_input_and_map_msp_do_not(setup, methods):
    """Same missing pattern, different inputs: the input-conditioned methods' prompts differ (so
    no MAP table reproduces them), MAP's and MSP's are equal. The context comes from the frozen
    backbone and never reads a missing modality's features."""
    model, feats, params = setup
    other = jax.tree.map(lambda x: x[::-1] + 1.0, feats)  # different inputs, same patterns
    variables = {"params": params}

    @jax.jit
    def context(f, missing):
        x, _ = model.apply(variables, f, missing, method="embed")
        return model.apply(variables, x, missing, method="modality_features")

    shifted = {m: (jax.jit(method.prompts), _shifted(pp)) for m, (method, pp) in methods.items()}
    for name, pattern in PATTERNS.items():
        missing = jnp.array(pattern)
        c1, c2 = context(feats, missing), context(other, missing)
        # A missing modality's features are zeros in the context, whatever its input values.
        np.testing.assert_array_equal(np.asarray(c1)[np.asarray(missing)], 0.0)
        noisy = {k: v + 100.0 * missing[:, i : i + 1] for i, (k, v) in enumerate(feats.items())}
        np.testing.assert_allclose(context(noisy, missing), c1, rtol=0, atol=1e-5)
        for m, (prompts, pp) in shifted.items():
            p1, _ = prompts(pp, missing, c1)
            p2, _ = prompts(pp, missing, c2)
            gap = np.abs(np.asarray(p1 - p2)).max(axis=(1, 2, 3))  # per example
            if m in ("dcp", "spr"):
                assert gap.min() > 1e-3, (m, name, gap)
            else:
                np.testing.assert_array_equal(gap, 0.0, err_msg=f"{m} {name}")
    # Each of SPR's modules alone reads the input (GIF, LFR, CFS; no module: only the table).
    missing = jnp.array(PATTERNS["img-missing"])
    c1, c2 = context(feats, missing), context(other, missing)
    for module in ("gif", "lfr", "cfs"):
        off = {k: False for k in ("gif", "lfr", "cfs") if k != module}
        spr = P.spr_prompts(**KW, hidden=8, **off)
        pp, prompts = _shifted(spr.init(jax.random.key(5))), jax.jit(spr.prompts)
        p1, _ = prompts(pp, missing, c1)
        p2, _ = prompts(pp, missing, c2)
        assert np.abs(np.asarray(p1 - p2)).max() > 1e-3, module


def test_spr_at_init_is_its_map_base_and_each_module_acts_as_specified(methods):
    spr, pp = methods["spr"]
    p, _ = jax.jit(spr.prompts)(pp, jnp.array(PATTERNS["mixed"]), CONTEXT)
    base = pp["prompts"][np.array([0, 1, 2] * (B // 3))]
    np.testing.assert_allclose(p, base, atol=1e-6)  # zero-initialised outputs, g = 1
    kw = dict(num_modalities=2, num_layers=3, num_tokens=5, dim=DIM, hidden=8)
    missing = jnp.array([[False, False], [True, False], [False, True]])
    context = CONTEXT[:3]

    def perturbed(method, names):
        params = method.init(jax.random.key(6))
        bump = lambda path, x: (  # noqa: E731
            x + 0.3 * jax.random.normal(jax.random.key(len(path)), x.shape)
            if any(n in jax.tree_util.keystr(path) for n in names)
            else x
        )
        return jax.tree_util.tree_map_with_path(bump, params)

    def change(method, params, at):  # which prompt entries move when base[:, at] moves
        prompts = jax.jit(method.prompts)
        base, _ = prompts(params, missing, context)
        moved = jax.tree.map(lambda x: x, params)
        moved["prompts"] = params["prompts"].at[at].add(1.0)
        out, _ = prompts(moved, missing, context)
        return np.abs(np.asarray(out - base)).max(-1) > 1e-7  # (types, L, T)

    # GIF is bidirectional along layers: the last layer's base prompt reaches layer 0.
    gif = P.spr_prompts(**kw, lfr=False, cfs=False)
    moved = change(gif, perturbed(gif, ["gif_out"]), (0, 2, 1))
    assert moved[0, 0, 1] and moved[0, 2, 1] and not moved[0, :, 0].any() and not moved[1:].any()
    # LFR mixes only adjacent tokens (kernel 3), within a layer.
    lfr = P.spr_prompts(**kw, gif=False, cfs=False)
    moved = change(lfr, perturbed(lfr, ["lfr_pw"]), (0, 1, 2))
    np.testing.assert_array_equal(moved[0, 1], [False, True, True, True, False])
    assert not moved[0, [0, 2]].any() and not moved[1:].any()
    # CFS scales every token of a (type, layer) by one gate per channel, in (0, 2).
    cfs = P.spr_prompts(**kw, gif=False, lfr=False)
    params = perturbed(cfs, ["cfs_2"])
    out, _ = cfs.prompts(params, missing, context)
    gate = np.asarray(out) / np.asarray(params["prompts"])
    np.testing.assert_allclose(gate, np.broadcast_to(gate[:, :, :1], gate.shape), rtol=1e-4)
    assert gate.min() > 0 and gate.max() < 2 and np.abs(gate[0] - gate[1]).max() > 1e-4


def test_dcp_generation_is_residual_and_correlates_the_modality_groups():
    kw = dict(num_modalities=2, num_layers=3, num_tokens=4, dim=DIM, bottleneck=4)
    dcp = dcp_prompts(**kw)
    pp = dcp.init(jax.random.key(7))
    missing = jnp.array([[False, False], [True, False]])
    context = CONTEXT[:2]
    p, _ = dcp.prompts(pp, missing, context)
    for layer in range(3):  # zero generators, common and dynamic prompts: every layer is the base
        np.testing.assert_allclose(p[:, layer], pp["prompts"][:2], atol=1e-6)
    pp = jax.tree.map(lambda x: x + 0.1, pp)
    base, _ = dcp.prompts(pp, missing, context)
    moved = dict(pp, prompts=pp["prompts"].at[0, 0].add(1.0))  # token 0 = modality group 0
    out, _ = dcp.prompts(moved, missing, context)
    diff = np.abs(np.asarray(out - base)).max(-1)[0]  # (L, T)
    assert diff[1, 2] > 1e-6  # group 1's token 0 (index 2) is generated from group 0's
    assert diff[1, 1] < 1e-7 and diff[1, 3] < 1e-7  # other positions are not


@pytest.mark.parametrize("name", ["dcp", "spr"])
def test_gradients_reach_prompts_and_head_never_the_backbone(setup, methods, name):
    model, feats, params = setup
    method, pp = methods[name]  # shifted, so that zero-initialised outputs pass gradients on
    pp = jax.tree.map(lambda x: x + 0.05, pp)
    frozen, head = split_head(params)
    trainable = {"prompts": pp, "head": head}
    missing = jnp.array(PATTERNS["mixed"])
    y = jnp.arange(B) % 4

    def loss(frozen, trainable):
        logits = prompted_logits(model, frozen, trainable, method, feats, missing)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    g_frozen, g_train = jax.jit(jax.grad(loss, argnums=(0, 1)))(frozen, trainable)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_frozen))
    for path, g in jax.tree_util.tree_leaves_with_path(g_train):
        assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize("mode", ["blank", "drop"])
def test_one_compilation_serves_every_missing_pattern(setup, methods, mode):
    model, feats, params = setup
    model = model.clone(missing_input=mode)
    method, pp = methods["map"]
    frozen, head = split_head(params)
    trainable = {"prompts": pp, "head": head}
    traces = []

    @jax.jit
    def logits(missing):
        traces.append(1)
        return prompted_logits(model, frozen, trainable, method, feats, missing)

    outs = {name: logits(jnp.array(pat)) for name, pat in PATTERNS.items()}
    assert len(traces) == 1
    mixed = np.asarray(outs["mixed"])  # row b of "mixed" equals row b under its own pattern
    for b, name in zip(range(3), ("complete", "img-missing", "txt-missing"), strict=True):
        np.testing.assert_allclose(mixed[b], outs[name][b], atol=1e-5)


def test_sample_missing_counts_and_types():
    m = sample_missing(jax.random.key(0), 100, num_modalities=2, rate=0.7)
    assert m.shape == (100, 2) and m.any(1).sum() == 70 and m.sum(0).tolist() == [35, 35]
    assert not m.all(1).any()
    m = sample_missing(jax.random.key(0), 100, num_modalities=3, rate=0.9, kind=1)
    assert m.sum(0).tolist() == [0, 90, 0]
    assert not sample_missing(
        jax.random.key(0), 9, num_modalities=2, rate=0.5, kind="complete"
    ).any()
    types = P.missing_type(jnp.array([[False, False], [True, False], [False, True]]))
    np.testing.assert_array_equal(types, [0, 1, 2])
    assert num_missing_types(3) == 7


def test_macro_f1_matches_sklearn():
    rng = np.random.default_rng(0)
    y, pred = rng.integers(0, 5, 200), rng.integers(0, 5, 200)
    pred[:50] = y[:50]
    want = f1_score(y, pred, average="macro", labels=range(6), zero_division=0)
    assert macro_f1(pred, y, num_classes=6) == pytest.approx(want, abs=1e-12)


def test_bad_inputs_raise_clear_errors(setup):
    model, feats, params = setup
    key = jax.random.key(0)
    for rate in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"missing rate must lie in \[0, 1\]"):
            sample_missing(key, 10, num_modalities=2, rate=rate)
    with pytest.raises(TypeError, match="missing rate must be a number"):
        sample_missing(key, 10, num_modalities=2, rate="0.5")
    with pytest.raises(ValueError, match="kind=2 is invalid"):
        sample_missing(key, 10, num_modalities=2, rate=0.5, kind=2)
    with pytest.raises(ValueError, match=r"unknown \['audio'\]"):
        model.apply({"params": params}, {**feats, "audio": feats["txt"]})
    with pytest.raises(ValueError, match=r"absent \['txt'\]"):
        model.apply({"params": params}, {"img": feats["img"]})
    with pytest.raises(ValueError, match=r"features\['txt'\] must have shape \(b, 5\)"):
        model.apply({"params": params}, {**feats, "txt": jnp.zeros((B, 6))})
    with pytest.raises(ValueError, match="missing must be a bool array"):
        model.apply({"params": params}, feats, jnp.zeros((B, 3), bool))
    with pytest.raises(ValueError, match="missing_input='mask' is invalid"):
        model.clone(missing_input="mask").apply({"params": params}, feats)
    with pytest.raises(ValueError, match="the backbone has 3"):
        model.apply({"params": params}, feats, prompts=jnp.zeros((B, 4, 2, DIM)))
    with pytest.raises(ValueError, match="missing must be a .* bool array"):
        map_prompts(num_modalities=2, num_layers=1, num_tokens=1, dim=DIM).prompts(
            {"prompts": jnp.zeros((3, 1, 1, DIM))}, jnp.zeros((2, 3), bool)
        )
    spr = P.spr_prompts(num_modalities=2, num_layers=1, num_tokens=2, dim=DIM, hidden=4)
    pp, missing = spr.init(key), jnp.zeros((2, 2), bool)
    with pytest.raises(ValueError, match="spr prompts are input-conditioned: pass context"):
        spr.prompts(pp, missing)
    with pytest.raises(ValueError, match=r"context must be a float array of shape \(b, M, d\)"):
        spr.prompts(pp, missing, jnp.zeros((2, 3, DIM)))
    with pytest.raises(ValueError, match="multiple of num_modalities"):
        dcp_prompts(num_modalities=2, num_layers=2, num_tokens=3, dim=DIM)
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        P.spr_prompts(num_modalities=2, num_layers=2, num_tokens=0, dim=DIM)
    with pytest.raises(ValueError, match="'head'"):
        split_head({"proj_0": {}})
