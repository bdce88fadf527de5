r"""LoRA and QLoRA on a small Llama-family decoder: pretrain on two genres, adapt to the third.

A byte-level (vocabulary 256) Llama-style ``DecoderLM`` (RoPE, GQA, SwiGLU, RMSNorm, layers
under ``nn.scan``) is pretrained from scratch on the comedies and tragedies of the First Folio
(``lowrank_jax.data.load_shakespeare``), written as a Hugging Face checkpoint
(``save_hf_decoder``) and read back (``load_hf_decoder``), then fine-tuned on the held-out genre,
the histories, with LoRA (r=8 on all seven projections, factors stacked on the layer axis) on
the float32 base and QLoRA (the same LoRA on an NF4 base). Each fine-tune gets the same budget:
the same steps and the same learning-rate grid, the rate chosen on a validation split of the
histories; test perplexity (per byte) is reported before and after, with samples, and the bytes
of the frozen base stored as float32, bfloat16, int8 and NF4 (and the perplexity each gives
before fine-tuning).

Commands (``:smoke`` for a one-minute check)::

    python -m experiments.train --config=configs/llm_lora.py
    python -m experiments.train --config=configs/llm_lora.py:smoke

Rerunning resumes: the pretraining and every fine-tuning cell are separate ``common.fit`` runs
under the workdir (``pretrain/``, ``finetune/<base>_lr<rate>/``); finished ones only re-evaluate.

Measured on the 2-core CPU shared with other jobs (load average 5-9): the default took 11.4 min
wall (8.8 CPU-minutes: 500 pretraining steps, 4 x 150 fine-tuning steps), ``:smoke`` 66 s. Expected
(default, seed 0): pretraining validation perplexity 6.28 per byte; on the histories' test
passages LoRA 6.66 -> 6.29 and QLoRA (NF4 base) 6.67 -> 6.29, both at the chosen rate 1e-2;
frozen base bytes float32 3.41 MB, bfloat16 0.54x, int8 0.31x, NF4 0.21x (the float32 byte
embeddings and norms are a large share of this tiny model; the projection kernels alone are
0.14x in NF4, see ``python -m experiments.bench.llm_lora``).
"""

import ml_collections

from configs.common import parse_arg, train_section


def get_config(arg=None):
    """``arg``: ``"smoke"``."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "llm_lora"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.pretrain_genres = ("comedy", "tragedy")
    c.data.finetune_genre = "history"
    c.data.passage_chars = 96 if arg.smoke else 128  # one training sequence per passage (bytes)
    c.data.max_passages_per_play = 60 if arg.smoke else 400
    c.data.valid_fraction = 0.1
    c.data.test_fraction = 0.2
    c.data.batch_size = 16
    c.data.finetune_examples = 256 if arg.smoke else 1024  # the held-out genre's training passages

    c.model = ml_collections.ConfigDict()
    c.model.hidden_size = 64 if arg.smoke else 128
    c.model.intermediate_size = 128 if arg.smoke else 384
    c.model.num_hidden_layers = 2 if arg.smoke else 4
    c.model.num_attention_heads = 4
    c.model.num_key_value_heads = 2
    c.model.dtype = "float32"  # compute dtype (bfloat16 is slower on CPU)
    c.model.remat_policy = ""  # "" (none) or a jax.checkpoint_policies name
    c.model.pretrain_steps = 150 if arg.smoke else 500
    c.model.pretrain_learning_rate = 3e-3

    c.adapter = ml_collections.ConfigDict()
    c.adapter.rank = 8
    c.adapter.alpha = 16.0
    c.adapter.targets = (r".*_proj/kernel",)  # all seven projections of every layer
    c.adapter.nf4_block_size = 64

    c.finetune = ml_collections.ConfigDict()
    c.finetune.methods = ("float32", "nf4")  # the frozen base of each fine-tune: LoRA, QLoRA
    c.finetune.bases = ("float32", "bfloat16", "int8", "nf4")  # bases whose bytes are reported
    c.finetune.learning_rates = (1e-2, 3e-2)  # the grid each method gets, chosen on validation

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 30 if arg.smoke else 150  # per fine-tuning run
    c.schedule.warmup_steps = 3 if arg.smoke else 15

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 32
    c.eval.every = 0  # evaluation at the end of each run only
    c.eval.sample_prompt_chars = 48
    c.eval.sample_tokens = 48 if arg.smoke else 96
    c.eval.num_samples = 2

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.every = 50 if arg.smoke else 200
    c.ckpt.max_to_keep = 1

    c.log = ml_collections.ConfigDict()
    c.log.every = 10 if arg.smoke else 50
    c.log.progress = True

    c.parallel = ml_collections.ConfigDict()
    c.parallel.fsdp = False
    c.parallel.distributed = False
    c.train = train_section()
    return c
