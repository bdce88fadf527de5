"""Peer check: torch-pruning's L1 and Taylor group importances equal ours on PyTorch copies
(an MLP's hidden neurons; a CNN's conv channels, across a flatten, and its dense units)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import analysis
from lowrank_jax.analysis.pruning import score_taylor, sequential_groups
from lowrank_jax.models import CNN, MLP

torch = pytest.importorskip("torch")
tp = pytest.importorskip("torch_pruning")


def test_l1_and_taylor_match_torch_pruning():
    model = MLP((12, 8), 3)
    x = jax.random.normal(jax.random.key(0), (32, 5))
    y = jnp.arange(32) % 3
    params = model.init(jax.random.key(1), x)
    p = params["params"]
    tm = torch.nn.Sequential(
        torch.nn.Linear(5, 12),
        torch.nn.ReLU(),
        torch.nn.Linear(12, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 3),
    )
    with torch.no_grad():
        for i, name in zip((0, 2, 4), ("dense_0", "dense_1", "head"), strict=True):
            tm[i].weight.copy_(torch.tensor(np.asarray(p[name]["kernel"]).T))
            tm[i].bias.copy_(torch.tensor(np.asarray(p[name]["bias"])))
    out = tm(torch.tensor(np.asarray(x)))
    np.testing.assert_allclose(out.detach().numpy(), np.asarray(model.apply(params, x)), atol=1e-5)
    torch.nn.functional.cross_entropy(out, torch.tensor(np.asarray(y)).long()).backward()
    _check_importances(
        tm, torch.randn(1, 5), params, model, x, y, {"dense_0": tm[0], "dense_1": tm[2]}
    )


def _check_importances(tm, example, params, model, x, y, layers):
    """torch-pruning's L1 / Taylor of each layer's output group (grads already in ``tm``)."""
    graph = tp.DependencyGraph().build_dependency(tm, example_inputs=example)
    groups = sequential_groups(params)
    l1 = analysis.score_l1(params, groups)
    taylor = score_taylor(model.apply, params, x, y, groups)
    mag = tp.importance.GroupMagnitudeImportance(p=1, group_reduction="sum", normalizer=None)
    tay = tp.importance.GroupTaylorImportance(group_reduction="sum", normalizer=None)
    for name, layer in layers.items():
        if isinstance(layer, torch.nn.Conv2d):
            fn, n = tp.prune_conv_out_channels, layer.out_channels
        else:
            fn, n = tp.prune_linear_out_channels, layer.out_features
        g = graph.get_pruning_group(layer, fn, idxs=list(range(n)))
        np.testing.assert_allclose(mag(g).numpy(), np.asarray(l1[name]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(tay(g).numpy(), np.asarray(taylor[name]), rtol=1e-4, atol=1e-7)


def test_cnn_channel_l1_and_taylor_match_torch_pruning():
    model = CNN((4, 6), (8,), 3)
    x = jax.random.uniform(jax.random.key(0), (16, 8, 8, 1))
    y = jnp.arange(16) % 3
    params = model.init(jax.random.key(1), x)
    p = jax.tree.map(np.asarray, params)["params"]
    nn = torch.nn
    tm = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(6 * 2 * 2, 8), nn.ReLU(), nn.Linear(8, 3),
    )  # fmt: skip
    with torch.no_grad():
        for i, name in ((0, "conv_0"), (3, "conv_1")):  # HWIO -> OIHW
            tm[i].weight.copy_(torch.tensor(p[name]["kernel"].transpose(3, 2, 0, 1)))
            tm[i].bias.copy_(torch.tensor(p[name]["bias"]))
        # Flax flattens NHWC (row s·C + c), torch NCHW (column c·S + s).
        k = p["dense_0"]["kernel"].reshape(4, 6, 8).transpose(1, 0, 2).reshape(24, 8)
        tm[7].weight.copy_(torch.tensor(k.T))
        tm[7].bias.copy_(torch.tensor(p["dense_0"]["bias"]))
        tm[9].weight.copy_(torch.tensor(p["head"]["kernel"].T))
        tm[9].bias.copy_(torch.tensor(p["head"]["bias"]))
    out = tm(torch.tensor(np.asarray(x).transpose(0, 3, 1, 2)))
    np.testing.assert_allclose(out.detach().numpy(), np.asarray(model.apply(params, x)), atol=1e-5)
    torch.nn.functional.cross_entropy(out, torch.tensor(np.asarray(y)).long()).backward()
    layers = {"conv_0": tm[0], "conv_1": tm[3], "dense_0": tm[7]}
    _check_importances(tm, torch.randn(1, 1, 8, 8), params, model, x, y, layers)
