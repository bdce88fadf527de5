r"""Fine-tune your own Hugging Face decoder checkpoint on your own JSONL data (LoRA, DoRA, QLoRA).

Any checkpoint ``models.load_hf_decoder`` reads (Llama-3, Qwen2/2.5, Gemma-2, Gemma-3 text; a
``save_pretrained`` directory with ``tokenizer.json``), and JSONL rows ``{"text"}``,
``{"prompt", "completion"}`` or ``{"messages"}`` (the checkpoint's chat template; loss on the
assistant turns), packed into rows of ``data.max_length`` tokens (``lowrank_jax.data.text``)::

    python -m experiments.train --config=configs/llm_sft.py --config.checkpoint=DIR \
        --config.data.train=train.jsonl [--config.data.valid=valid.jsonl] --workdir=runs/sft
    python -m experiments.train --config=configs/llm_sft.py:smoke   # no checkpoint needed

Options: ``--config.adapter.method=dora`` (DoRA), ``frameft`` (FrameFT, P10) or ``sbvi``
(spectral adapters trained by SBVI, P8; no PEFT ``adapter/`` for these two, ``merged/`` as for all),
``--config.adapter.init=lora_da`` (LoRA-DA, P6, from ``adapter.init_rows`` packed training rows) or
``pissa`` (the base trained on is the residual), ``--config.adapter.base=nf4`` (QLoRA: the frozen
projections in 4-bit NormalFloat; also ``bfloat16``, ``int8``), ``--config.export.merged=True``
(also write ``<workdir>/merged/``, an HF checkpoint with the adapter folded in and the tokenizer
files copied). **Compute dtype**: ``model.dtype`` (default ``float32``, which a CPU runs fastest
and which matches ``transformers`` in float32; use ``bfloat16`` on a TPU or GPU); parameters stay
float32 (``model.param_dtype``). Without ``data.valid``, ``data.valid_fraction`` of the training
rows are held out for validation.

``--config.data.train=a.jsonl,b.jsonl --config.continual.method=saber`` (or ``gr_lora``,
``o_lora``, ``inflora``, ``sd_lora``, ``sequential``; also ``:smoke,continual=saber``): continual
fine-tuning, one task per file, with per-task losses and forgetting;
``--config.select.fraction=0.25`` (GIST, P11: keep the rows chosen for ``select.target`` or the
validation rows); ``--config.data.train=tfds:NAME[@SPLIT]`` (a TFDS dataset; ``data.tfds_text``);
``--config.fp8.enabled=True`` (also ``:smoke,fp8``): attention logits in simulated FP8 E4M3 at
P14's geometry-aware scales from the adapted W_Q, W_K (RoPE-safe bound), overflow counts logged
next to a naive amax scale's.
See docs/guides/finetune_checkpoint.md.

Outputs in the workdir: ``adapter/`` (PEFT ``adapter_model.safetensors`` + ``adapter_config.json``:
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR), "<workdir>/adapter")``),
``results.md`` (validation loss and perplexity before and after, greedy samples before and after),
``metrics.jsonl``, checkpoints (rerunning the command resumes), and the final JSON with
``valid_loss_before`` and ``valid_loss_after``.

``:smoke`` builds in ``<workdir>/fixture`` a random tiny Llama saved by ``transformers``
(2 layers, hidden 32), a BPE tokenizer trained with ``tokenizers`` on First Folio lines with a
ChatML template, and train/valid JSONL files of the three row forms
(``experiments/common/llm_fixture.py``; needs ``transformers``, the ``peers`` extra), then runs
40 LoRA steps and writes the merged checkpoint too. Measured on the shared 2-core CPU (load
5-7): 33 s wall for ``:smoke``; its validation loss falls from 6.243 (about ln 512: the random
model) to 6.187 (the random model's small output head bounds how far rank-8 adapters on the
projections move it in 40 steps). The default's runtime is the checkpoint's and the data's.
"""

import ml_collections

from configs.common import hardware_section, parse_arg, profile_section, train_section


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"method=<adapter.method>"`` (e.g. ``"smoke,method=sbvi"``),
    ``"continual=<continual.method>"``, ``"fp8"`` (``fp8.enabled``)."""
    arg = parse_arg(arg, smoke=False, method="lora", continual="", fp8=False)
    c = ml_collections.ConfigDict()
    c.experiment = "llm_sft"
    c.seed = 0
    c.checkpoint = ""  # a save_pretrained directory with tokenizer.json (required unless fixture)
    c.fixture = arg.smoke  # build a tiny checkpoint and data in <workdir>/fixture when unset

    c.data = ml_collections.ConfigDict()
    # Sources, comma-separated: JSONL files of rows {"text"}, {"prompt", "completion"} or
    # {"messages"}, or tfds:NAME[@SPLIT]; several train sources: the tasks of continual.method.
    c.data.train = ""
    c.data.valid = ""  # one source per train source; "" holds out valid_fraction of each
    c.data.tfds_text = "text"  # tfds: the feature read as {"text"} rows
    c.data.tfds_prompt = ""  # tfds: with tfds_completion, {"prompt", "completion"} rows instead
    c.data.tfds_completion = ""
    c.data.tfds_max_rows = 0  # tfds: rows read per source (0: all)
    c.data.valid_fraction = 0.1
    c.data.max_length = 128 if arg.smoke else 1024  # tokens per packed row
    c.data.batch_size = 8  # packed rows per step (a multiple of the device count)

    c.model = ml_collections.ConfigDict()
    c.model.dtype = "float32"  # compute dtype: float32 (CPU) or bfloat16 (TPU/GPU)
    c.model.param_dtype = "float32"
    c.model.remat_policy = ""  # "" (none) or a jax.checkpoint_policies name

    c.adapter = ml_collections.ConfigDict()
    c.adapter.method = arg.method  # "lora", "dora", "frameft" (P10) or "sbvi" (P8)
    c.adapter.init = "kaiming"  # LoRA's: "kaiming" (B = 0), "pissa" or "lora_da" (P6)
    c.adapter.init_rows = 8 if arg.smoke else 64  # packed training rows lora_da reads
    c.adapter.frame_coeff = 256 if arg.smoke else 4096  # frameft: coefficients per kernel
    c.adapter.frame_scale = 50.0  # frameft: the delta's scale
    c.adapter.sbvi_temperature = 1e-6  # sbvi: T0 of q(sigma), annealed to 0 over 80% of steps
    c.adapter.sbvi_friction = 1e-3  # sbvi: lambda, the ARD prior's weight (prunes modes)
    c.adapter.base = "float32"  # the frozen base: float32, bfloat16, int8 or nf4 (QLoRA)
    c.adapter.rank = 8
    c.adapter.alpha = 16.0
    c.adapter.targets = (r".*_proj/kernel",)  # all seven projections of every layer
    c.adapter.nf4_block_size = 32 if arg.smoke else 64  # divides every kernel's input axis

    c.continual = ml_collections.ConfigDict()  # one task per train source, in order
    c.continual.method = (
        arg.continual
    )  # "": off; saber, gr_lora, o_lora, inflora, sd_lora, sequential
    c.continual.memory_examples = 4 if arg.smoke else 64  # packed rows feeding the memories
    c.continual.memory_threshold = 0.9  # GPM energy (inflora, gr_lora)
    c.continual.lambda_orth = 0.5  # o_lora's penalty weight

    c.select = ml_collections.ConfigDict()  # GIST (P11) on the training rows before fine-tuning
    c.select.fraction = 0.0  # rows kept (0: all, no selection)
    c.select.target = ""  # the target source ("": the validation rows)
    c.select.k = 8  # GIST's directions (at most the target's rows)
    c.select.chunk_size = 16  # examples per vmap chunk of per-example gradients

    c.fp8 = ml_collections.ConfigDict()  # P14: attention logits in simulated FP8 E4M3
    c.fp8.enabled = arg.fp8  # train and evaluate with geometry-aware scales; overflows logged
    c.fp8.bound = "rank_aware"  # P14's alpha ("rank_agnostic") or "worst_case" (no overflow)
    c.fp8.delta = 1e-6  # failure probability of the rank-aware / rank-agnostic bound
    c.fp8.calibration = 1.0  # c: the scale times c (> 1 narrows the range the bound leaves)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-2 if arg.smoke else 2e-4
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 40 if arg.smoke else 1000
    c.schedule.warmup_steps = 4 if arg.smoke else 50

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 8
    c.eval.every = 0  # validation every this many steps (0: at the end only)
    c.eval.num_samples = 3  # greedy samples in results.md (prompts of validation rows)
    c.eval.sample_tokens = 24 if arg.smoke else 64

    c.export = ml_collections.ConfigDict()
    c.export.merged = arg.smoke  # also write <workdir>/merged (an HF checkpoint + tokenizer)
    c.export.merged_dtype = ""  # its stored dtype ("": model.param_dtype)

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.every = 20 if arg.smoke else 200
    c.ckpt.max_to_keep = 2

    c.log = ml_collections.ConfigDict()
    c.log.every = 10 if arg.smoke else 50
    c.log.progress = True

    c.parallel = ml_collections.ConfigDict()
    c.parallel.fsdp = False
    c.parallel.distributed = False
    c.train = train_section()
    c.hardware = hardware_section()
    c.profile = profile_section()
    return c
