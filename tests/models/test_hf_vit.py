"""`load_hf_vit` against PyTorch `transformers` on random tiny ViT checkpoints.

Each checkpoint is built from a config (no download), every parameter redrawn (so that the
LayerNorms, biases, class token and position embeddings matter), saved with `save_pretrained` and
read back. Checked in float32 at 1e-5: the logits of `ViTForImageClassification`, the pooler
output of `ViTModel`, and the class token of its last hidden state, over configurations that
differ in image size (square and not), patch size, width, channels, activation, qkv biases and
the pooler's width; then the scanned and unrolled layouts, LoRA on the stacked kernels, a fresh
head, the preprocessing file, and the refusals of bad directories (one line each).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters, models
from lowrank_jax.models.hf_vit import ImagePreprocessing, preprocessing

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOL = 1e-5
# name -> (HF class, ViTConfig fields)
CASES = {
    "model_pooler": (
        "ViTModel",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            image_size=16,
            patch_size=4,
            pooler_output_size=20,
        ),
    ),
    "model_no_pooler_rect": (
        "ViTModel",
        dict(
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=3,
            intermediate_size=40,
            image_size=[12, 20],
            patch_size=4,
            qkv_bias=False,
            hidden_act="gelu_new",
        ),
    ),
    "classifier": (
        "ViTForImageClassification",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=6,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
            num_channels=1,
            num_labels=7,
        ),
    ),
}


def _redraw(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if "layernorm" in name and name.endswith("weight") else noise)


def _save(case: str, directory) -> str:
    cls, fields = CASES[case]
    config = transformers.ViTConfig(**fields)
    kwargs = {"add_pooling_layer": False} if case == "model_no_pooler_rect" else {}
    model = getattr(transformers, cls)(config, **kwargs).eval()
    _redraw(model, seed=len(case))
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {case: _save(case, tmp_path_factory.mktemp(case)) for case in CASES}


def _images(case: str, batch: int = 3) -> np.ndarray:
    fields = CASES[case][1]
    size = fields["image_size"]
    h, w = (size, size) if isinstance(size, int) else size
    c = fields.get("num_channels", 3)
    return np.random.default_rng(0).standard_normal((batch, h, w, c)).astype(np.float32)


def _reference(directory: str, case: str, images: np.ndarray) -> dict[str, np.ndarray]:
    cls = CASES[case][0]
    kwargs = {"add_pooling_layer": False} if case == "model_no_pooler_rect" else {}
    model = getattr(transformers, cls).from_pretrained(directory, **kwargs).eval()
    with torch.no_grad():
        out = model(torch.from_numpy(images.transpose(0, 3, 1, 2)), output_hidden_states=True)
    ref = {"cls": out.hidden_states[-1][:, 0].numpy()}  # before the final LayerNorm
    if cls == "ViTForImageClassification":
        ref["output"] = out.logits.numpy()
    else:
        ref["cls"] = out.last_hidden_state[:, 0].numpy()
        pooled = out.pooler_output
        ref["output"] = ref["cls"] if pooled is None else pooled.numpy()
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_equal_transformers(checkpoints, case):
    images = _images(case)
    ref = _reference(checkpoints[case], case, images)
    model, variables = models.load_hf_vit(checkpoints[case])
    assert jax.tree.leaves(variables)[0].dtype == jnp.float32
    out = jax.jit(model.apply)(variables, images)
    assert out.shape == ref["output"].shape
    np.testing.assert_allclose(np.asarray(out), ref["output"], atol=TOL, rtol=0)


def test_layouts_and_a_fresh_head_on_the_class_token(checkpoints):
    case = "model_pooler"  # a fresh head reads the class token: the saved pooler is not used
    directory, images = checkpoints[case], _images(case)
    scanned, sv = models.load_hf_vit(directory, num_classes=5, key=jax.random.key(1))
    unrolled, uv = models.load_hf_vit(
        directory, num_classes=5, key=jax.random.key(1), scan_layers=False
    )
    assert sv["params"]["encoder"]["layers"]["attention"]["query"]["kernel"].shape == (2, 32, 32)
    assert uv["params"]["encoder"]["layer_1"]["mlp"]["fc1"]["kernel"].shape == (32, 37)
    assert "pooler" not in sv["params"] and sv["params"]["head"]["kernel"].shape == (32, 5)
    np.testing.assert_allclose(
        scanned.apply(sv, images), unrolled.apply(uv, images), atol=TOL, rtol=0
    )
    body = {"params": {k: v for k, v in sv["params"].items() if k != "head"}}
    cls = scanned.clone(num_classes=0).apply(body, images)
    ref = _reference(directory, case, images)
    np.testing.assert_allclose(np.asarray(cls), ref["cls"], atol=TOL, rtol=0)


def test_lora_targets_every_projection_of_the_stack(checkpoints):
    case = "classifier"
    model, variables = models.load_hf_vit(checkpoints[case])
    rules = [
        (r".*attention/(query|key|value|out)/kernel", adapters.lora(2, in_ndim=1, out_ndim=1)),
        (r".*mlp/(fc1|fc2)/kernel", adapters.lora(2, in_ndim=1, out_ndim=1)),
    ]
    lora = adapters.init(jax.random.key(0), variables, rules)
    paths = {p.rsplit("/", 2)[-2] for p in lora}
    assert paths == {"query", "key", "value", "out", "fc1", "fc2"}
    images = _images(case)
    base = model.apply(variables, images)
    adapted = adapters.adapt(model.apply)(variables, lora, images)
    np.testing.assert_allclose(adapted, base, atol=TOL, rtol=0)  # B = 0 at init


def test_preprocessing_reads_the_processor_file_or_defaults(checkpoints, tmp_path):
    directory = checkpoints["model_no_pooler_rect"]
    assert preprocessing(directory) == ImagePreprocessing((12, 20), (0.5,) * 3, (0.5,) * 3)
    transformers.ViTImageProcessor(
        size={"height": 40, "width": 24},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(directory)
    pre = preprocessing(directory)
    assert pre.size == (40, 24)
    np.testing.assert_allclose(pre.mean, [0.485, 0.456, 0.406])
    np.testing.assert_allclose(pre.std, [0.229, 0.224, 0.225])
    os.remove(os.path.join(directory, "preprocessor_config.json"))


def test_a_tfds_batch_prepared_for_the_checkpoint_runs_through_it(checkpoints):
    tfds = pytest.importorskip("tensorflow_datasets")
    from lowrank_jax import data

    case = "model_pooler"  # 16 x 16 images, mean = std = 0.5 (no preprocessor file)
    pre = preprocessing(checkpoints[case])
    model, variables = models.load_hf_vit(checkpoints[case], num_classes=4, key=jax.random.key(0))
    with tfds.testing.mock_data(num_examples=6):
        source = data.tfds_image_source("cifar100", split="test", num_threads=1)
        transform = data.train_transform(pre.size[0], mean=pre.mean, std=pre.std)
        batch = next(
            data.ImageBatches(
                source, np.arange(len(source)), transform=transform, batch_size=len(source), seed=0
            )
        )
    assert batch["x"].shape == (len(source), 16, 16, 3)
    assert np.all(np.abs(batch["x"]) <= 1.0)  # [0, 1] normalised by 0.5 / 0.5
    logits = model.apply(variables, batch["x"])
    assert logits.shape == (len(source), 4) and np.isfinite(logits).all()


def _copy(src: str, dst, *, config=None, weights=True) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf if config is None else config(hf), f)
    if weights:
        with open(os.path.join(src, "model.safetensors"), "rb") as f:
            data = f.read()
        with open(os.path.join(dst, "model.safetensors"), "wb") as f:
            f.write(data if weights is True else weights(data))
    return str(dst)


def _bert(hf):
    return {**hf, "model_type": "bert"}


def _wider(hf):
    return {**hf, "hidden_size": 60}


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda src, d: str(d / "absent"), FileNotFoundError, "is not a directory"),
        (lambda src, d: str(d), FileNotFoundError, "config.json does not exist"),
        (lambda src, d: _copy(src, d, weights=False), FileNotFoundError, "neither model"),
        (lambda src, d: _copy(src, d, config=_bert), ValueError, "not 'vit'"),
        (lambda src, d: _copy(src, d, weights=lambda b: b[: len(b) // 2]), ValueError, "truncated"),
        (lambda src, d: _copy(src, d, config=_wider), ValueError, "the config needs"),
    ],
    ids=["no_directory", "no_config", "no_weights", "not_vit", "truncated", "wrong_shape"],
)
def test_bad_directories_are_refused_in_one_line(checkpoints, tmp_path, make, error, words):
    directory = make(checkpoints["classifier"], tmp_path)
    with pytest.raises(error, match=words) as info:
        models.load_hf_vit(directory)
    assert "\n" not in str(info.value)


def test_tensors_no_parameter_takes_are_refused(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = _copy(checkpoints["model_pooler"], tmp_path)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    save_file(
        {**tensors, "embeddings.mask_token": np.zeros((1, 1, 32), np.float32)},
        os.path.join(directory, "model.safetensors"),
    )
    with pytest.raises(ValueError, match="unused tensors.*mask_token"):
        models.load_hf_vit(directory)
    with pytest.raises(ValueError, match="needs key="):
        models.load_hf_vit(checkpoints["model_pooler"], num_classes=3)
