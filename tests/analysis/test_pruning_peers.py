"""Peer check: torch-pruning's L1 and Taylor group importances equal ours on a PyTorch copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import analysis
from lowrank_jax.models import MLP

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
    graph = tp.DependencyGraph().build_dependency(tm, example_inputs=torch.randn(1, 5))
    groups = analysis.mlp_groups(params)
    l1 = analysis.score_l1(params, groups)
    taylor = analysis.score_taylor(model.apply, params, x, y, groups)
    for i, name in ((0, "dense_0"), (2, "dense_1")):
        g = graph.get_pruning_group(
            tm[i], tp.prune_linear_out_channels, idxs=list(range(tm[i].out_features))
        )
        mag = tp.importance.GroupMagnitudeImportance(p=1, group_reduction="sum", normalizer=None)
        tay = tp.importance.GroupTaylorImportance(group_reduction="sum", normalizer=None)
        np.testing.assert_allclose(mag(g).numpy(), np.asarray(l1[name]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(tay(g).numpy(), np.asarray(taylor[name]), rtol=1e-4, atol=1e-7)
