"""PEFT parity beyond linear LoRA: embedding and convolution LoRA, DoRA, bias training and
modules_to_save, both ways against real PyTorch PEFT on a small model with every kind of layer.

The model: an embedding (11, 6), a Conv1d (6 -> 5, window 3, padding 1), a Conv2d (5 -> 4, window
(3, 2)), a Linear (4 -> 3), a LayerNorm and a Linear head (3 -> 2). Ours is a plain JAX function over
a params dict in flax's layouts (kernels (in, out), conv kernels (*window, in, out)).
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters as A
from lowrank_jax.adapters.paths import named_leaves
from tests.adapters.models import perturb, perturb_torch

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "peft")),
    reason="needs the peers extra (pip install -e '.[peers]')",
)

_KEYS = iter(jax.random.split(jax.random.key(0), 16))
_rand = lambda *shape: 0.5 * jax.random.normal(next(_KEYS), shape)
PARAMS = {
    "emb": {"embedding": _rand(11, 6)},
    "c1": {"kernel": _rand(3, 6, 5), "bias": _rand(5)},
    "c2": {"kernel": _rand(3, 2, 5, 4), "bias": _rand(4)},
    "lin": {"kernel": _rand(4, 3), "bias": _rand(3)},
    "ln": {"scale": 1.0 + _rand(3), "bias": _rand(3)},
    "head": {"kernel": _rand(3, 2), "bias": _rand(2)},
}
MAIN = {"emb": "embedding", "c1": "kernel", "c2": "kernel", "lin": "kernel", "ln": "scale"}
MAIN["head"] = "kernel"
IDS = np.array([[1, 2, 3, 4, 5, 6], [0, 9, 10, 3, 3, 7]])


def module_name(path: str) -> str:
    module, leaf = path.split("/")
    if MAIN.get(module) != leaf:
        raise ValueError(f"{path!r} is not a module's main parameter.")
    return module


def module_path(name: str) -> str:
    if name not in MAIN:
        raise ValueError(f"no module {name!r}")
    return f"{name}/{MAIN[name]}"


def forward(p, ids):
    h = jnp.take(p["emb"]["embedding"], ids, axis=0)  # (b, t, 6)
    dn = ("NWC", "WIO", "NWC")
    h = jax.lax.conv_general_dilated(h, p["c1"]["kernel"], (1,), [(1, 1)], dimension_numbers=dn)
    h = jax.nn.relu(h + p["c1"]["bias"])
    h = jnp.repeat(h[:, :, None, :], 3, axis=2)  # (b, t, 3, 5)
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(h, p["c2"]["kernel"], (1, 1), "VALID", dimension_numbers=dn)
    h = jnp.mean(h + p["c2"]["bias"], axis=(1, 2))
    h = h @ p["lin"]["kernel"] + p["lin"]["bias"]
    mu, var = jnp.mean(h, -1, keepdims=True), jnp.var(h, -1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-5) * p["ln"]["scale"] + p["ln"]["bias"]
    return h @ p["head"]["kernel"] + p["head"]["bias"]


def _torch_weight(value, leaf):
    value = np.asarray(value)
    if leaf == "kernel":
        nd = value.ndim
        value = np.transpose(value, (nd - 1, nd - 2, *range(nd - 2)))
    return value.copy()


def _torch_net():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.c1 = torch.nn.Conv1d(6, 5, 3, padding=1)
            self.c2 = torch.nn.Conv2d(5, 4, (3, 2))
            self.lin = torch.nn.Linear(4, 3)
            self.ln = torch.nn.LayerNorm(3)
            self.head = torch.nn.Linear(3, 2)

        def forward(self, ids):
            h = self.emb(ids).transpose(1, 2)
            h = torch.relu(self.c1(h))
            h = self.c2(h[..., None].expand(-1, -1, -1, 3))
            return self.head(self.ln(self.lin(h.mean((2, 3)))))

    net = Net()
    with torch.no_grad():
        for module, leaves in PARAMS.items():
            for leaf, value in leaves.items():
                name = "bias" if leaf == "bias" else "weight"
                getattr(getattr(net, module), name).copy_(
                    torch.from_numpy(_torch_weight(value, leaf))
                )
    return net


def _torch_out(model):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(IDS)).numpy()


def test_the_torch_twin_computes_forward():
    np.testing.assert_allclose(_torch_out(_torch_net().eval()), forward(PARAMS, IDS), atol=1e-5)


@pytest.mark.parametrize(
    "targets, bias, saved",
    [
        (["emb", "c1", "c2", "lin"], "none", None),
        (["emb", "c1", "c2", "lin"], "all", ["head", "ln"]),
        (["c1", "lin"], "lora_only", ["head"]),
    ],
)
def test_peft_adapter_loads_exactly(tmp_path, targets, bias, saved):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=targets,
        bias=bias,
        modules_to_save=saved,
        init_lora_weights=False,
    )
    model = perturb_torch(get_peft_model(_torch_net(), config), 0.1)
    model.eval().save_pretrained(str(tmp_path))
    theirs = _torch_out(model)

    lora, trained = A.load_peft(tmp_path, PARAMS, module_path=module_path, with_trained=True)
    assert sorted(lora) == sorted(module_path(t) for t in targets)
    assert lora["c1/kernel"].in_ndim == 2 and lora["c1/kernel"].factors["a"].shape == (18, 2)
    got = {p for p, v in named_leaves(trained).items() if v is not None}
    want = {f"{m}/{leaf}" for m in saved or () for leaf in PARAMS[m]}
    want |= {f"{m}/bias" for m in targets if bias != "none" and "bias" in PARAMS[m]}
    if bias == "all":
        want |= {f"{m}/bias" for m in PARAMS if "bias" in PARAMS[m]}
    assert got == want
    ours = jax.jit(A.adapt(forward))(A.combine(trained, PARAMS), lora, IDS)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_our_adapter_loads_in_peft_and_back(tmp_path):
    from peft import PeftModel

    rules = [
        (r"emb/embedding", A.lora(2, alpha=4.0)),
        (r"c1/kernel", A.lora(2, in_ndim=2)),
        (r"c2/kernel", A.lora(3, alpha=2.0, in_ndim=3)),
        (r"lin/kernel", A.lora(2)),
    ]
    lora = perturb(A.init(jax.random.key(1), PARAMS, rules), 0.2)
    trained, _ = A.split_trainable(PARAMS, [r"lin/bias", r"c2/bias", r"head/.*", r"ln/bias"])
    trained = jax.tree.map(lambda t: t + 0.3, trained)
    A.save_peft(tmp_path, lora, module_name=module_name, params=PARAMS, trained=trained)
    theirs = _torch_out(PeftModel.from_pretrained(_torch_net(), str(tmp_path)).eval())
    ours = A.adapt(forward)(A.combine(trained, PARAMS), lora, IDS)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)

    back, back_trained = A.load_peft(tmp_path, PARAMS, module_path=module_path, with_trained=True)
    for path, ad in lora.items():
        for f in ("a", "b"):
            np.testing.assert_allclose(back[path].factors[f], ad.factors[f], rtol=1e-6)
    for path, value in named_leaves(trained).items():
        np.testing.assert_array_equal(named_leaves(back_trained)[path], value)


@pytest.mark.parametrize("direction", ["peft_to_ours", "ours_to_peft"])
def test_dora_matches_peft(tmp_path, direction):
    from peft import LoraConfig, PeftModel, get_peft_model

    if direction == "peft_to_ours":
        config = LoraConfig(r=2, lora_alpha=4, target_modules=["lin", "head"], use_dora=True)
        model = perturb_torch(get_peft_model(_torch_net(), config), 0.2, seed=1)
        model.eval().save_pretrained(str(tmp_path))
        dora = A.load_peft(tmp_path, PARAMS, module_path=module_path)
        assert isinstance(dora["lin/kernel"].kind, A.DoRA)
    else:
        dora = A.init(jax.random.key(2), PARAMS, [(r"(lin|head)/kernel", A.dora(2, alpha=4.0))])
        dora = jax.tree.map(lambda t: t + 0.2, dora)
        A.save_peft(tmp_path, dora, module_name=module_name)
        model = PeftModel.from_pretrained(_torch_net(), str(tmp_path)).eval()
        assert model.peft_config["default"].use_dora
    theirs = _torch_out(model)
    np.testing.assert_allclose(A.adapt(forward)(PARAMS, dora, IDS), theirs, atol=1e-5)
    np.testing.assert_allclose(forward(A.fold(PARAMS, dora), IDS), theirs, atol=1e-5)


def test_what_we_cannot_honour_is_still_refused_by_name(tmp_path):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, target_modules=["emb"], use_dora=True, init_lora_weights=False)
    get_peft_model(_torch_net(), config).save_pretrained(str(tmp_path / "dora_emb"))
    with pytest.raises(ValueError, match="DoRA on an embedding or a convolution"):
        A.load_peft(tmp_path / "dora_emb", PARAMS, module_path=module_path)
    config = LoraConfig(r=2, target_modules=["lin"], lora_bias=True)
    get_peft_model(_torch_net(), config).save_pretrained(str(tmp_path / "lora_bias"))
    with pytest.raises(ValueError, match="lora_bias=True cannot be loaded"):
        A.load_peft(tmp_path / "lora_bias", PARAMS, module_path=module_path)
    config = LoraConfig(r=2, target_modules=["lin"], bias="all")
    get_peft_model(_torch_net(), config).save_pretrained(str(tmp_path / "bias"))
    with pytest.raises(ValueError, match="pass with_trained=True"):
        A.load_peft(tmp_path / "bias", PARAMS, module_path=module_path)
