"""PEFT format: exact round trip, the layout PEFT expects, and (with the peers extra) PyTorch PEFT."""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from lowrank_jax import adapters as A
from tests.adapters.models import perturb

PARAMS = {
    "fc1": {"kernel": jax.random.normal(jax.random.key(0), (8, 16)), "bias": jnp.zeros(16)},
    "fc2": {"kernel": jax.random.normal(jax.random.key(1), (16, 4)), "bias": jnp.zeros(4)},
}
RULES = [
    (r"fc1/kernel", A.lora(4, alpha=8.0, dropout=0.1)),
    (r"fc2/kernel", A.lora(2, dropout=0.1)),
]
module_name = lambda path: path.split("/")[0]
module_path = lambda name: f"{name}/kernel"


@pytest.fixture()
def saved(tmp_path):
    ad = perturb(A.init(jax.random.key(2), PARAMS, RULES), 0.05)
    A.save_peft(tmp_path, ad, module_name=module_name, base_model="toy")
    return tmp_path, ad


def test_round_trip_is_exact(saved):
    directory, ad = saved
    back = A.load_peft(directory, PARAMS, module_path=module_path)
    assert sorted(back) == sorted(ad)
    for path in ad:
        for k in ("a", "b"):
            np.testing.assert_array_equal(back[path].factors[k], ad[path].factors[k])
        assert back[path].kind.scale == ad[path].kind.scale
        np.testing.assert_array_equal(
            A.delta(back[path], PARAMS[path.split("/")[0]]["kernel"].shape),
            A.delta(ad[path], PARAMS[path.split("/")[0]]["kernel"].shape),
        )


def test_layout_is_peft(saved):
    directory, ad = saved
    tensors = load_file(directory / "adapter_model.safetensors")
    assert tensors["base_model.model.fc1.lora_A.weight"].shape == (4, 8)  # (r, in)
    assert tensors["base_model.model.fc1.lora_B.weight"].shape == (16, 4)  # (out, r)
    np.testing.assert_array_equal(
        tensors["base_model.model.fc2.lora_A.weight"], np.asarray(ad["fc2/kernel"].factors["a"]).T
    )
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["target_modules"] == ["fc1", "fc2"]
    # One of the two ranks/alphas is the default, the other goes into the patterns.
    ranks = {m: config["rank_pattern"].get(m, config["r"]) for m in ("fc1", "fc2")}
    alphas = {m: config["alpha_pattern"].get(m, config["lora_alpha"]) for m in ("fc1", "fc2")}
    assert ranks == {"fc1": 4, "fc2": 2} and alphas == {"fc1": 8.0, "fc2": 2.0}
    assert config["lora_dropout"] == 0.1


def test_load_checks_shapes(saved):
    directory, _ = saved
    wrong = {"fc1": {"kernel": jnp.zeros((9, 16))}, "fc2": {"kernel": jnp.zeros((16, 4))}}
    with pytest.raises(ValueError, match="needs A"):
        A.load_peft(directory, wrong, module_path=module_path)
    with pytest.raises(ValueError, match="not in params"):
        A.load_peft(directory, PARAMS, module_path=lambda n: f"encoder/{n}/kernel")


def test_save_rejects_unequal_dropout(tmp_path):
    rules = [(r"fc1/kernel", A.lora(2, dropout=0.1)), (r"fc2/kernel", A.lora(2))]
    ad = A.init(jax.random.key(2), PARAMS, rules)
    with pytest.raises(ValueError, match="lora_dropout"):
        A.save_peft(tmp_path, ad, module_name=module_name)


def test_save_rejects_stacked(tmp_path):
    ad = A.init(
        jax.random.key(0), {"w": jnp.ones((3, 4, 4))}, [("w", A.lora(2, in_ndim=1, out_ndim=1))]
    )
    with pytest.raises(ValueError, match="stacked"):
        A.save_peft(tmp_path, ad, module_name=lambda p: p)


def test_stacked_layers_round_trip_one_module_per_layer(tmp_path):
    params = {"layers": {"w": jax.random.normal(jax.random.key(0), (3, 8, 6))}}
    ad = perturb(
        A.init(jax.random.key(1), params, [("layers/w", A.lora(2, in_ndim=1, out_ndim=1))]), 0.1
    )
    name = lambda path, layer: f"layers.{layer}.w"
    path_of = lambda n: ("layers/w", int(n.split(".")[1]))
    A.save_peft(tmp_path, ad, module_name=name)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    np.testing.assert_array_equal(
        tensors["base_model.model.layers.2.w.lora_B.weight"],
        np.asarray(ad["layers/w"].factors["b"][2]).T,
    )
    back = A.load_peft(tmp_path, params, module_path=path_of)
    for k in ("a", "b"):
        np.testing.assert_array_equal(back["layers/w"].factors[k], ad["layers/w"].factors[k])
    # A layer PEFT did not adapt (layers_to_transform) loads as zero factors: no update there.
    from safetensors.numpy import save_file

    del tensors["base_model.model.layers.1.w.lora_A.weight"]
    del tensors["base_model.model.layers.1.w.lora_B.weight"]
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    partial = A.load_peft(tmp_path, params, module_path=path_of)
    assert not np.any(partial["layers/w"].factors["b"][1])
    np.testing.assert_array_equal(
        partial["layers/w"].factors["a"][2], ad["layers/w"].factors["a"][2]
    )
    # Per-layer ranks or alphas cannot be one stacked adapter.
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"layers.0.w": 7.0}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="different \\(rank, alpha\\)"):
        A.load_peft(tmp_path, params, module_path=path_of)


@pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("torch") is None,
    reason="needs the peers extra (pip install -e '.[peers]')",
)
def test_pytorch_peft_loads_it_and_agrees(saved):
    import torch
    from peft import PeftModel

    directory, ad = saved

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    net = Net()
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            getattr(net, name).weight.copy_(
                torch.from_numpy(np.asarray(PARAMS[name]["kernel"]).T.copy())
            )
            getattr(net, name).bias.zero_()
    peft_model = PeftModel.from_pretrained(net, str(directory)).eval()
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8)
    with torch.no_grad():
        theirs = peft_model(torch.from_numpy(x)).numpy()

    def ours(p, x):
        h = jax.nn.relu(x @ p["fc1"]["kernel"] + p["fc1"]["bias"])
        return h @ p["fc2"]["kernel"] + p["fc2"]["bias"]

    np.testing.assert_allclose(A.adapt(ours)(PARAMS, ad, x), theirs, atol=1e-5)


def test_stacked_dora_absent_layer_keeps_the_kernel(tmp_path):
    # A DoRA layer PEFT did not adapt loads as b = 0 and m = the column norms of W, so W' = W;
    # the kernel may have several output axes (n, heads, head_dim): its norms are over n.
    from safetensors.numpy import save_file

    params = {"layers": {"w": jax.random.normal(jax.random.key(0), (3, 8, 2, 3))}}
    rules = [("layers/w", A.dora(2, in_ndim=1, out_ndim=2))]
    ad = perturb(A.init(jax.random.key(1), params, rules), 0.1)
    name = lambda path, layer: f"layers.{layer}.w"
    path_of = lambda n: ("layers/w", int(n.split(".")[1]))
    A.save_peft(tmp_path, ad, module_name=name)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    for kind in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector"):
        del tensors[f"base_model.model.layers.1.w.{kind}"]
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    back = A.load_peft(tmp_path, params, module_path=path_of, rules=rules)["layers/w"].factors
    norms = np.linalg.norm(np.asarray(params["layers"]["w"][1]).reshape(8, 6), axis=0)
    np.testing.assert_allclose(np.reshape(back["m"][1], -1), norms, rtol=1e-6)
    assert not np.any(back["b"][1])
    np.testing.assert_array_equal(back["m"][2], ad["layers/w"].factors["m"][2])
