"""PEFT interop edge cases: pattern keys, refused features, named sets, broken configs.

The tests marked ``peers`` write adapters with real PyTorch PEFT (the ``peers`` extra, installed by
``make test``) and check that what we load computes what PEFT computes, or is refused by name.
"""

import importlib.util
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters as A
from lowrank_jax.adapters.paths import named_leaves
from tests.adapters.models import perturb

HAVE_PEFT = all(importlib.util.find_spec(m) is not None for m in ("torch", "peft"))
peers = pytest.mark.skipif(not HAVE_PEFT, reason="needs the peers extra (make install)")

PARAMS = {
    "enc": {
        "fc1": {"kernel": jax.random.normal(jax.random.key(0), (8, 16)), "bias": jnp.zeros(16)},
        "fc2": {"kernel": jax.random.normal(jax.random.key(1), (16, 4)), "bias": jnp.zeros(4)},
    }
}
module_name = lambda path: ".".join(path.split("/")[:-1])  # enc/fc1/kernel -> enc.fc1
module_path = lambda name: name.replace(".", "/") + "/kernel"


def forward(p, x):
    h = jax.nn.relu(x @ p["enc"]["fc1"]["kernel"] + p["enc"]["fc1"]["bias"])
    return h @ p["enc"]["fc2"]["kernel"] + p["enc"]["fc2"]["bias"]


X = np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8)


def _torch_net(embedding: bool = False):
    import torch

    class Enc(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 4)
            if embedding:
                self.emb = torch.nn.Embedding(10, 8)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = Enc()

        def forward(self, x):
            return self.enc.fc2(torch.relu(self.enc.fc1(x)))

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            layer = getattr(net.enc, name)
            layer.weight.copy_(torch.from_numpy(np.asarray(PARAMS["enc"][name]["kernel"]).T.copy()))
            layer.bias.zero_()
    return net


def _peft_save(tmp_path, embedding: bool = False, **lora_kwargs):
    """Writes a PEFT LoRA adapter with non-zero B and returns (directory, PEFT model outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model

    targets = ["fc1", "fc2"] + (["emb"] if embedding else [])
    config = LoraConfig(target_modules=targets, init_lora_weights=False, **lora_kwargs)
    model = get_peft_model(_torch_net(embedding), config).eval()
    model.save_pretrained(str(tmp_path))
    with torch.no_grad():
        out = model(torch.from_numpy(X)).numpy()
    return tmp_path, out


@peers
def test_the_guide_quotes_the_peft_requirement_that_is_installed():
    import configparser
    import importlib.metadata
    import pathlib

    from packaging.requirements import Requirement

    root = pathlib.Path(__file__).resolve().parents[2]
    guide = (root / "docs" / "guides" / "peft.md").read_text()
    assert not re.search(r"PEFT \d+\.\d+", guide), "quote the requirement, not a version"
    setup = configparser.ConfigParser()
    setup.read(root / "setup.cfg")
    peers = setup["options.extras_require"]["peers"].split()
    (pinned,) = [Requirement(r) for r in peers if Requirement(r).name == "peft"]
    (quoted,) = [Requirement(q) for q in re.findall(r"`(peft[<>=!~][^`]*)`", guide)]
    assert quoted.specifier == pinned.specifier, (str(quoted), str(pinned))
    assert pinned.specifier.contains(importlib.metadata.version("peft"))


@peers
def test_rank_and_alpha_patterns_match_module_suffixes_as_peft_does(tmp_path):
    directory, theirs = _peft_save(
        tmp_path, r=4, lora_alpha=8, rank_pattern={"fc2": 2}, alpha_pattern={"fc1": 32}
    )
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {"fc2": 2}  # a suffix, not the full name "enc.fc2"
    lora = A.load_peft(directory, PARAMS, module_path=module_path)
    assert lora["enc/fc2/kernel"].kind.rank == 2 and lora["enc/fc1/kernel"].kind.rank == 4
    assert lora["enc/fc1/kernel"].kind.scale == pytest.approx(32 / 4)
    assert lora["enc/fc2/kernel"].kind.scale == pytest.approx(8 / 2)
    np.testing.assert_allclose(A.adapt(forward)(PARAMS, lora, X), theirs, atol=1e-5)


@peers
@pytest.mark.parametrize(
    "kwargs, embedding, message",
    [
        ({"lora_bias": True}, False, "lora_bias"),
        ({"use_dora": True}, True, "DoRA on an embedding"),
        ({"bias": "lora_only"}, False, "with_trained=True"),
        ({"modules_to_save": ["fc2"]}, False, "with_trained=True"),
    ],
)
def test_features_we_cannot_honour_are_refused_by_name(tmp_path, kwargs, embedding, message):
    directory, _ = _peft_save(tmp_path, embedding=embedding, r=2, **kwargs)
    with pytest.raises(ValueError, match=message):
        A.load_peft(
            directory,
            {**PARAMS, "enc": {**PARAMS["enc"], "emb": {"kernel": jnp.ones((10, 8))}}},
            module_path=module_path,
        )


@peers
def test_named_sets_save_one_directory_each_and_load_in_peft(tmp_path):
    import torch
    from peft import PeftModel

    sets = {
        "shakespeare": perturb(
            A.init(jax.random.key(2), PARAMS, [(r".*fc1/kernel", A.lora(4, alpha=8.0))]), 0.05
        ),
        "marlowe": perturb(A.init(jax.random.key(3), PARAMS, [(r".*fc2/kernel", A.lora(2))]), 0.05),
    }
    written = A.save_peft(tmp_path, sets, module_name=module_name, base_model="toy")
    assert written == [str(tmp_path / "shakespeare"), str(tmp_path / "marlowe")]
    model = PeftModel.from_pretrained(_torch_net(), written[0], adapter_name="shakespeare").eval()
    model.load_adapter(written[1], adapter_name="marlowe")
    for name, directory in zip(sets, written, strict=True):
        model.set_adapter(name)
        with torch.no_grad():
            theirs = model(torch.from_numpy(X)).numpy()
        np.testing.assert_allclose(A.adapt(forward)(PARAMS, sets[name], X), theirs, atol=1e-5)
        back = A.load_peft(directory, PARAMS, module_path=module_path)
        assert sorted(back) == sorted(sets[name])
    assert (
        json.loads((tmp_path / "marlowe" / "adapter_config.json").read_text())[
            "base_model_name_or_path"
        ]
        == "toy"
    )


@pytest.fixture()
def saved(tmp_path):
    lora = perturb(A.init(jax.random.key(2), PARAMS, [(r".*kernel", A.lora(2))]), 0.05)
    A.save_peft(tmp_path, lora, module_name=module_name)
    return tmp_path


def _edit_config(directory, edit):
    file = directory / "adapter_config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def test_garbled_or_incomplete_config_names_the_file_and_key(saved):
    file = saved / "adapter_config.json"
    text = file.read_text()
    file.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"adapter_config.json is not valid JSON"):
        A.load_peft(saved, PARAMS, module_path=module_path)
    file.write_text(text)
    _edit_config(saved, lambda c: c.pop("lora_alpha"))
    with pytest.raises(ValueError, match=r"adapter_config.json has no 'lora_alpha'"):
        A.load_peft(saved, PARAMS, module_path=module_path)
    file.write_text(text)
    _edit_config(saved, lambda c: c.update(r="four"))
    with pytest.raises(ValueError, match=r"'r' must be a number"):
        A.load_peft(saved, PARAMS, module_path=module_path)
    file.write_text(text)
    _edit_config(saved, lambda c: c.update(some_future_flag=True))
    with pytest.raises(ValueError, match=r"some_future_flag=True cannot be loaded"):
        A.load_peft(saved, PARAMS, module_path=module_path)
    (saved / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json does not exist"):
        A.load_peft(saved, PARAMS, module_path=module_path)


def test_tensors_that_are_not_lora_factors_are_refused(saved):
    from safetensors.numpy import load_file, save_file

    file = str(saved / "adapter_model.safetensors")
    tensors = load_file(file)
    save_file({**tensors, "base_model.model.enc.fc1.bias": np.zeros(16, np.float32)}, file)
    with pytest.raises(ValueError, match="'enc.fc1.bias', ...: bias or modules_to_save"):
        A.load_peft(saved, PARAMS, module_path=module_path)
    with pytest.raises(ValueError, match="'enc.fc1.bias' is not a LoRA factor, and the config"):
        A.load_peft(saved, PARAMS, module_path=module_path, with_trained=True)  # bias="none"
    tensors.pop("base_model.model.enc.fc2.lora_B.weight")
    save_file(tensors, file)
    with pytest.raises(ValueError, match="'enc.fc2' has no lora_B tensor"):
        A.load_peft(saved, PARAMS, module_path=module_path)


def test_pattern_keys_follow_peft_order_and_regex_semantics(saved):
    # The first matching key wins; a key is a regex over the dotted suffix; "c2" is no suffix.
    _edit_config(
        saved, lambda c: c.update(lora_alpha=2, alpha_pattern={"c2": 99, "fc.": 4, "fc2": 8})
    )
    lora = A.load_peft(saved, PARAMS, module_path=module_path)
    assert lora["enc/fc1/kernel"].kind.scale == pytest.approx(4 / 2)
    assert lora["enc/fc2/kernel"].kind.scale == pytest.approx(4 / 2)


def test_save_rejects_what_is_not_a_lora_set(tmp_path):
    with pytest.raises(ValueError, match="empty adapter set"):
        A.save_peft(tmp_path, {}, module_name=module_name)
    with pytest.raises(TypeError, match="PEFT export is LoRA and DoRA only"):
        A.save_peft(tmp_path, {"enc/fc1/kernel": 3.0}, module_name=module_name)


def test_conv_paths_writes_a_dense_general_out_projection_as_a_linear_lora(tmp_path):
    # flax attention's out-projection kernel (heads, head_dim, features) has a conv kernel's shape
    # (window, in, out); by default it is written as a Conv1d LoRA, with conv_paths=() as the
    # nn.Linear(heads * head_dim, features) LoRA that PyTorch's attention has.
    from safetensors.numpy import load_file

    params = {"attn": {"out": {"kernel": jnp.ones((2, 3, 4))}}}
    rule = A.lora(2, in_ndim=2, out_ndim=1)
    lora = perturb(A.init(jax.random.key(0), params, [(r".*out/kernel", rule)]))
    a = np.asarray(lora["attn/out/kernel"].factors["a"])
    shapes = {}
    for conv in (None, ()):
        out = A.save_peft(tmp_path / str(conv), lora, module_name=module_name, params=params,
                          conv_paths=conv)[0]  # fmt: skip
        tensors = load_file(f"{out}/adapter_model.safetensors")
        (name,) = [k for k in tensors if "lora_A" in k]
        shapes[conv] = tensors[name].shape
    assert shapes[None] == (2, 3, 2)  # (r, in, window): a Conv1d LoRA
    assert shapes[()] == (2, 6)  # (r, heads * head_dim): a Linear LoRA
    np.testing.assert_array_equal(tensors[name], a.T)
    one = r".*out/kernel"  # a str is one regex
    A.save_peft(tmp_path / "named", lora, module_name=module_name, params=params, conv_paths=one)
    tensors = load_file(f"{tmp_path}/named/adapter_model.safetensors")
    assert next(v for k, v in tensors.items() if "lora_A" in k).shape == (2, 3, 2)
    with pytest.raises(ValueError, match="'.*conv/kernel' matches no adapted kernel"):
        A.save_peft(tmp_path / "typo", lora, module_name=module_name, params=params,
                    conv_paths=[r".*conv/kernel"])  # fmt: skip
    with pytest.raises(ValueError, match="conv_paths=...\\) needs params="):
        A.save_peft(tmp_path / "no_params", lora, module_name=module_name, conv_paths=())


def test_a_truncated_adapter_file_is_named(saved):
    file = saved / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])  # an interrupted copy
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is not a readable .*again"):
        A.load_peft(saved, PARAMS, module_path=module_path)


def test_save_into_an_unwritable_directory_says_so_in_one_line(tmp_path):
    lora = perturb(A.init(jax.random.key(2), PARAMS, [(r".*kernel", A.lora(2))]), 0.05)
    (tmp_path / "a_file").write_text("")
    for directory in (tmp_path / "a_file", tmp_path / "a_file" / "adapter"):
        with pytest.raises(OSError, match=rf"save_peft cannot write to '{directory}'") as error:
            A.save_peft(directory, lora, module_name=module_name)
        assert "\n" not in str(error.value)
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "read_only").mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="save_peft cannot write to"):
            A.save_peft(tmp_path / "read_only", lora, module_name=module_name)


def test_target_modules_that_match_nothing_are_refused_as_peft_does(saved):
    _edit_config(saved, lambda c: c.update(target_modules=["q_proj", "v_proj"]))
    with pytest.raises(
        ValueError, match=r"match none of the adapter's modules \('enc.fc1', 'enc.fc2'\)"
    ):
        A.load_peft(saved, PARAMS, module_path=module_path)
    _edit_config(saved, lambda c: c.update(target_modules=r".*\.q_proj"))  # a str is a regex
    with pytest.raises(ValueError, match="PEFT refuses such an adapter"):
        A.load_peft(saved, PARAMS, module_path=module_path)
    for targets in (["fc1", "q_proj"], r"enc\.fc\d", None):  # a suffix, a regex, PEFT's default
        _edit_config(saved, lambda c, t=targets: c.update(target_modules=t))
        assert sorted(A.load_peft(saved, PARAMS, module_path=module_path)) == [
            "enc/fc1/kernel",
            "enc/fc2/kernel",
        ]


def test_a_rank_clash_names_the_configs_r(saved):
    _edit_config(saved, lambda c: c.update(r=4))
    with pytest.raises(ValueError, match=r"'enc.fc\d' have rank 2 .* config's r=4 says rank 4"):
        A.load_peft(saved, PARAMS, module_path=module_path)
    _edit_config(saved, lambda c: c.update(r=2, rank_pattern={"fc2": 3}))
    with pytest.raises(ValueError, match=r"'enc.fc2' have rank 2 .* rank_pattern \(3 for it\)"):
        A.load_peft(saved, PARAMS, module_path=module_path)


POOLED = {
    "fc": {"kernel": 0.5 * jax.random.normal(jax.random.key(4), (8, 8)), "bias": jnp.zeros(8)},
    "pooler": {
        "dense": {"kernel": 0.5 * jax.random.normal(jax.random.key(5), (8, 4)), "bias": jnp.ones(4)}
    },
}


def _pooled_forward(p, x):  # a BERT-like pooler: tanh(dense(h)) over the first position
    h = x @ p["fc"]["kernel"] + p["fc"]["bias"]
    return jnp.tanh(h @ p["pooler"]["dense"]["kernel"] + p["pooler"]["dense"]["bias"])


def _pooled_torch_net():
    import torch

    class Pooler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(8, 4)

        def forward(self, h):
            return torch.tanh(self.dense(h))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.pooler = Pooler()

        def forward(self, x):
            return self.pooler(self.fc(x))

    net = Net()
    with torch.no_grad():
        for layer, leaves in (
            (net.fc, POOLED["fc"]),
            (net.pooler.dense, POOLED["pooler"]["dense"]),
        ):
            layer.weight.copy_(torch.from_numpy(np.asarray(leaves["kernel"]).T.copy()))
            layer.bias.copy_(torch.from_numpy(np.asarray(leaves["bias"]).copy()))
    return net


@peers
@pytest.mark.parametrize("bias", ["none", "all"])
def test_modules_to_save_naming_a_parent_module_loads_and_saves_as_peft_does(tmp_path, bias):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    def outputs(model):
        with torch.no_grad():
            return model(torch.from_numpy(X)).numpy()

    config = LoraConfig(
        r=2, target_modules=["fc"], modules_to_save=["pooler"], bias=bias, init_lora_weights=False
    )
    model = get_peft_model(_pooled_torch_net(), config).eval()
    with torch.no_grad():  # the trained copy of the pooler differs from the base
        model.base_model.model.pooler.modules_to_save["default"].dense.bias.add_(0.5)
    model.save_pretrained(str(tmp_path / "theirs"))
    lora, trained = A.load_peft(
        tmp_path / "theirs", POOLED, module_path=module_path, with_trained=True
    )
    assert named_leaves(trained)["pooler/dense/bias"] is not None
    ours = A.adapt(_pooled_forward)(A.combine(trained, POOLED), lora, X)
    np.testing.assert_allclose(ours, outputs(model), atol=1e-5)
    # And back: saved as the module that holds the trained leaves, which PEFT loads alike.
    A.save_peft(tmp_path / "ours", lora, module_name=module_name, params=POOLED, trained=trained)
    again = PeftModel.from_pretrained(_pooled_torch_net(), str(tmp_path / "ours")).eval()
    np.testing.assert_allclose(outputs(again), outputs(model), atol=1e-5)
