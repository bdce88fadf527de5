"""Fine-tuning a user's checkpoint (configs/llm_sft.py): the ``:smoke`` run end to end through the
CLI (a random tiny Llama saved by ``transformers``, a BPE tokenizer, JSONL rows of the three
forms); the written adapter loads in PyTorch PEFT and its greedy tokens equal the library
sampler's; the merged checkpoint equals the adapted model; a run killed after a checkpoint resumes
to the same result; DoRA and QLoRA by config; a bad JSONL row fails in one line naming it."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import llm_sft as sft_config
from experiments import common, llm_sft
from experiments.common import llm_sft_steps
from lowrank_jax import adapters, data, models
from tests.experiments.test_train_cli import final_metrics, run_cli

SMOKE = "--config=configs/llm_sft.py:smoke"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The ``:smoke`` run through the CLI: ``(workdir, final metrics)``."""
    pytest.importorskip("transformers")
    workdir = tmp_path_factory.mktemp("sft")
    proc = run_cli(SMOKE, "--config.log.progress=False", workdir=workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return workdir, final_metrics(proc.stdout)


def test_smoke_run_writes_the_adapter_merged_checkpoint_and_report(smoke):
    workdir, metrics = smoke
    assert not metrics["interrupted"]
    assert metrics["valid_loss_after"] < metrics["valid_loss_before"]
    assert metrics["valid_ppl_before"] == pytest.approx(np.exp(metrics["valid_loss_before"]))
    assert metrics["train_rows"] == 192 and metrics["valid_rows"] == 48
    config = json.loads((workdir / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["task_type"] == "CAUSAL_LM" and not config["use_dora"]
    assert len(config["target_modules"]) == 7 * 2  # seven projections in each of two layers
    merged = workdir / "merged"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (merged / name).is_file(), name
    table = (workdir / "results.md").read_text()
    assert "| validation loss (nats per target token) |" in table
    assert table.count("   - after: ") == 3 and "## Cost" in table
    assert common.read_metrics(workdir)[-1]["step"] == 40


def test_the_adapter_loads_in_pytorch_peft_with_the_greedy_tokens_of_our_sampler(smoke):
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    workdir, _ = smoke
    checkpoint = workdir / "fixture" / "checkpoint"
    tok = data.load_tokenizer(checkpoint)
    chat = [{"role": "user", "content": "To be, or not to be, that is the Question"}]
    prompt = tok.encode(data.tokenizer.apply_chat_template(tok, chat, add_generation_prompt=True), add_special_tokens=False)  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="eager"
    )
    theirs = peft.PeftModel.from_pretrained(base, workdir / "adapter").eval()
    with torch.no_grad():
        out = theirs.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None
        )
        hf_logits = theirs(input_ids=torch.tensor([prompt])).logits.numpy()
    hf_tokens = out[0, len(prompt) :].numpy()

    config = models.config_from_hf(checkpoint, dtype="float32")
    _, variables = models.load_hf_decoder(checkpoint, config=config)
    lora = adapters.load_peft(
        workdir / "adapter", variables, module_path=models.decoder_path_from_module
    )
    adapted = adapters.adapt(models.DecoderLM(config).apply)
    ours = models.generate(
        models.DecoderLM(config),
        {"base": variables, "lora": lora},
        jnp.asarray([prompt]),
        max_new_tokens=16,
        forward=lambda v, *a, **k: adapted(v["base"], v["lora"], *a, **k),
    )
    np.testing.assert_array_equal(np.asarray(ours)[0], hf_tokens)
    logits = adapted(variables, lora, jnp.asarray([prompt]))
    np.testing.assert_allclose(np.asarray(logits), hf_logits, atol=1e-4, rtol=0)
    with theirs.disable_adapter(), torch.no_grad():  # the adapter changes the model
        plain = theirs(input_ids=torch.tensor([prompt])).logits.numpy()
    assert np.abs(plain - hf_logits).max() > 1e-3
    # The merged checkpoint is the adapted model, and its tokenizer loads.
    merged = transformers.AutoModelForCausalLM.from_pretrained(workdir / "merged").eval()
    with torch.no_grad():
        folded = merged(input_ids=torch.tensor([prompt])).logits.numpy()
    np.testing.assert_allclose(folded, hf_logits, atol=1e-4, rtol=0)
    again = transformers.AutoTokenizer.from_pretrained(workdir / "merged")
    assert again.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        data.tokenizer.apply_chat_template(tok, chat, add_generation_prompt=True)
    )


def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_result(smoke, tmp_path):
    """As after SIGKILL at step 39: only the checkpoint of step 20 and the records before it."""
    workdir, first = smoke
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    shutil.rmtree(copy / "checkpoints" / "40")
    for name in ("adapter", "merged"):
        shutil.rmtree(copy / name)
    config = sft_config.get_config("smoke")
    config.log.progress = False
    again = llm_sft.run(config, str(copy))  # (options from the config, as the CLI builds them)
    for key in ("valid_loss_before", "valid_loss_after"):
        assert again[key] == pytest.approx(first[key], rel=1e-6, abs=1e-6)
    steps = [r["step"] for r in common.read_metrics(copy) if "train/loss" in r]
    assert steps == [10, 20, 30, 40]
    assert (copy / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(("method", "base"), [("dora", "float32"), ("lora", "nf4")])
def test_dora_and_qlora_by_config(smoke, tmp_path, method, base):
    workdir, _ = smoke
    config = sft_config.get_config("smoke")
    config.checkpoint = str(workdir / "fixture" / "checkpoint")
    config.data.train = str(workdir / "fixture" / "train.jsonl")
    config.adapter.method, config.adapter.base = method, base
    config.schedule.num_steps, config.schedule.warmup_steps = 6, 1
    config.eval.num_samples, config.export.merged = 0, method == "dora"  # (no sampler compile)
    config.log.progress = False
    metrics = llm_sft.run(config, str(tmp_path))
    assert metrics["valid_rows"] == 19  # 10% of the 192 training rows held out (no valid file)
    assert metrics["valid_loss_after"] < metrics["valid_loss_before"]
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["use_dora"] == (method == "dora")
    assert (tmp_path / "merged" / "model.safetensors").is_file() == (method == "dora")


def _merged_valid_loss(config, workdir):
    """The validation loss of ``<workdir>/merged`` loaded as a plain checkpoint (no adapter)."""
    files = llm_sft.inputs(config, str(workdir))
    tok = data.load_tokenizer(files["checkpoint"])
    _, valid = llm_sft.load_examples(config, tok, files)
    packed = data.pack(valid, max_length=config.data.max_length, pad_id=tok.pad_token_id)
    mc = llm_sft.model_config(config, str(workdir / "merged"))
    _, merged = models.load_hf_decoder(workdir / "merged", config=mc)
    forward = llm_sft.make_forward(models.DecoderLM(mc))
    evaluate = llm_sft.make_evaluate(forward, common.make_mesh(), batch_size=config.eval.batch_size)
    return evaluate({}, merged, packed)["valid/loss"]


@pytest.mark.parametrize(
    ("method", "init"),
    [("lora", "lora_da"), ("lora", "pissa"), ("frameft", "kaiming"), ("sbvi", "kaiming")],
)
def test_paper_methods_by_config(smoke, tmp_path, method, init):
    """LoRA-DA (P6) and PiSSA initialisation, FrameFT (P10), SBVI (P8): the validation loss
    falls, and the merged checkpoint (folded into the base trained on, SBVI at its posterior
    mean) has the adapted model's validation loss; PEFT's adapter/ only for LoRA layouts."""
    workdir, _ = smoke
    config = sft_config.get_config("smoke")
    config.checkpoint = str(workdir / "fixture" / "checkpoint")
    config.data.train = str(workdir / "fixture" / "train.jsonl")
    config.adapter.method, config.adapter.init = method, init
    config.adapter.frame_scale = 5.0  # (at 50 the held-out loss moves by < 1e-3 in 10 steps)
    config.schedule.num_steps, config.schedule.warmup_steps = 10, 1
    config.eval.num_samples = 0
    config.log.progress = False
    metrics = llm_sft.run(config, str(tmp_path))
    assert metrics["valid_loss_after"] < metrics["valid_loss_before"]
    merged = _merged_valid_loss(config, tmp_path)
    assert merged == pytest.approx(metrics["valid_loss_after"], abs=1e-4)
    assert abs(merged - metrics["valid_loss_before"]) > 1e-3
    table = (tmp_path / "results.md").read_text()
    assert f"`adapter.init={init}`" in table
    peft = method in llm_sft_steps.PEFT_METHODS
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file() == peft
    assert ("No PEFT `adapter/` is written" in table) == (not peft)
    if method == "sbvi":  # every target keeps some of its 2 layers x 8 modes
        ranks = metrics["sbvi_ranks"]
        assert len(ranks) == 7 and all(1 <= r <= 16 for r in ranks.values()), ranks


def test_initialisers_keep_or_move_the_base(smoke):
    """``lora_da`` starts away from zero on the unchanged base; ``pissa`` takes its triples out
    of the base (base + adapter = the checkpoint)."""
    workdir, _ = smoke
    config = sft_config.get_config("smoke")
    checkpoint = workdir / "fixture" / "checkpoint"
    config.checkpoint, config.data.train = str(checkpoint), str(workdir / "fixture" / "train.jsonl")
    files = llm_sft.inputs(config, str(workdir))
    tok = data.load_tokenizer(checkpoint)
    train, _ = llm_sft.load_examples(config, tok, files)
    packed = data.pack(train, max_length=config.data.max_length, pad_id=tok.pad_token_id)
    mc = llm_sft.model_config(config, str(checkpoint))
    _, variables = models.load_hf_decoder(checkpoint, config=mc)
    model = models.DecoderLM(mc)
    q = "params/model/layers/self_attn/q_proj/kernel"
    kernel = lambda v: np.asarray(v["params"]["model"]["layers"]["self_attn"]["q_proj"]["kernel"])  # noqa: E731
    config.adapter.init = "lora_da"
    ad, base = llm_sft.initial_adapters(config, model, variables, packed)
    assert base is variables and np.abs(np.asarray(ad[q].factors["b"])).max() > 0
    config.adapter.init = "pissa"
    ad, base = llm_sft.initial_adapters(config, model, variables, packed)
    assert np.abs(kernel(base) - kernel(variables)).max() > 1e-3
    np.testing.assert_allclose(kernel(adapters.fold(base, ad)), kernel(variables), atol=1e-5)


def test_a_bad_row_fails_in_one_line_naming_file_and_line(smoke, tmp_path):
    workdir, _ = smoke
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine row"}\n{"prompt": "no completion"}\n')
    proc = run_cli(
        SMOKE,
        f"--config.checkpoint={workdir / 'fixture' / 'checkpoint'}",
        f"--config.data.train={bad}",
        workdir=tmp_path / "run",
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("FATAL ValueError: ") and f"{bad}:2: " in last
    assert "fix or remove the line" in last and "Traceback" not in proc.stderr


def test_config_errors_say_what_to_pass(tmp_path):
    config = sft_config.get_config()
    with pytest.raises(common.ConfigError, match="--config.checkpoint=DIR .* or use configs/llm_sft.py:smoke"):  # fmt: skip
        llm_sft.check_config(config)
    config.checkpoint, config.data.train = str(tmp_path), str(tmp_path / "t.jsonl")
    with pytest.raises(common.ConfigError, match="no config.json there"):
        llm_sft.check_config(config)
    config = sft_config.get_config("smoke")
    config.adapter.method = "vera"
    with pytest.raises(common.ConfigError, match=r"adapter.method='vera' .* 'lora', 'dora', 'frameft', 'sbvi'"):  # fmt: skip
        llm_sft.check_config(config)
    config = sft_config.get_config("smoke")
    config.adapter.init = "eva"
    with pytest.raises(common.ConfigError, match=r"adapter.init='eva' .* 'kaiming', 'pissa', 'lora_da'"):  # fmt: skip
        llm_sft.check_config(config)
    config.adapter.method, config.adapter.init = "dora", "lora_da"
    with pytest.raises(common.ConfigError, match="initialise LoRA only"):
        llm_sft.check_config(config)


def test_the_train_step_lowers_without_a_checkpoint():
    """``steps`` needs no file: the smoke's architecture is the fixture's, known in advance."""
    config = sft_config.get_config("smoke")
    (step,) = llm_sft.steps(config)
    state = step.args[0]
    assert state["adapters"]["params/model/layers/self_attn/q_proj/kernel"].factors["a"].shape == (
        2,
        32,
        8,
    )
    assert jax.eval_shape(step.fn, *step.args)[1]["loss"].shape == ()
