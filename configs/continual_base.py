"""The shared builder of ``configs/saber.py`` and ``configs/gr_lora.py`` (small lookups only).

Not a config to run by itself: it has no ``get_config``.
"""

import ml_collections

from configs.common import ConfigError, hardware_section, parse_arg, profile_section, train_section

METHODS = ("saber", "gr_lora", "seq_lora", "o_lora", "inflora", "gpm_lora", "sd_lora", "joint")

_MLP_TARGETS = (r"params/dense_\d+/kernel",)
_VIT_TARGETS = (
    r"params/encoder/layer_\d+/attention/(query|value)/kernel",
    r"params/encoder/layer_\d+/mlp/fc1/kernel",
)
_VIT = dict(model="vit", steps=200, smoke_tasks=2, targets=_VIT_TARGETS)
# The pre-trained ViT-B/16 benchmarks (a Hugging Face checkpoint, config.model.checkpoint; TFDS
# data read on demand, config.data.data_dir). Hyper-parameters of InfLoRA's public configurations
# (github.com/liangyanshuo/InfLoRA, configs/cifar100_inflora.json, mimg{5,10,20}_inflora.json,
# domainnet_inflora.json): Adam, batch 128, LoRA rank 10 on the key and value projections
# (DomainNet: rank 30), lr 5e-4, 20 epochs per task on CIFAR-100, 50 on ImageNet-R, 5 on
# DomainNet, classes in ascending id order (shuffle: false). Deviations: a constant learning
# rate (InfLoRA decays it), Adam on DomainNet (InfLoRA: SGD lr 5e-3); SD-LoRA's ImageNet-R
# configuration (exps/sdlora_inr.json of SD-LoRA's repository: Adam lr 1e-2, 20 epochs, batch
# 128, seed 1995 with shuffled classes) is the alternative --config.optim.learning_rate=1e-2
# --config.schedule.epochs_per_task=20 --config.data.shuffle_classes=True --config.seeds=(1995,).
# the layers stacked under nn.scan (params/encoder/layers, kernels (L, n, m)) or unrolled (layer_i)
_HF_VIT_TARGETS = (r"params/encoder/(layers|layer_\d+)/attention/(key|value)/kernel",)
_VIT_B16 = dict(
    model="vit_b16",
    pretrain=0,
    steps=0,
    batch_size=128,
    learning_rate=5e-4,
    rank=10,
    smoke_tasks=2,
    targets=_HF_VIT_TARGETS,
    head="masked",
    memory_examples=256,
)
# Per benchmark: tasks, backbone, steps per task (full / smoke), batch size, learning rate.
_BENCH = {
    # head (config.head): aligned, which won on validation for every continual method on
    # split_mnist, mnist_cil and long_stream, for all but GR-LoRA on shakespeare_plays and for 5 of
    # 7 on digits_cil (docs/papers/p01_saber.md); masked on the task-incremental split_digits (the task id picks the
    # columns)
    "split_digits": dict(
        num_tasks=5, model="mlp", features=(128, 128), pretrain=300, steps=300, head="masked"
    ),
    "digits_cil": dict(
        num_tasks=5, model="mlp", features=(128, 128), pretrain=0, steps=200, smoke_tasks=2
    ),
    "long_stream": dict(
        num_tasks=20,
        model="mlp",
        features=(256, 256),
        pretrain=0,
        steps=200,
        smoke_tasks=4,
    ),
    "shakespeare_plays": dict(
        num_tasks=5,
        model="minilm",
        pretrain=0,
        steps=80,
        batch_size=16,
        learning_rate=1e-3,
        memory_examples=64,
        ood_batch=16,
        targets=(
            r"params/layer_\d+/attention/(query|value)/kernel",
            r"params/layer_\d+/mlp/fc1/kernel",
        ),
    ),
    "split_mnist": dict(_VIT, num_tasks=3, pretrain=800),
    # MNIST 10 classes in 5 tasks of 2 on a ViT pretrained on Fashion-MNIST (no digit seen)
    "mnist_cil": dict(_VIT, num_tasks=5, pretrain=1500),
    "cifar100_10": dict(_VIT_B16, num_tasks=10, epochs=20),
    "imagenet_r_5": dict(_VIT_B16, num_tasks=5, epochs=50),
    "imagenet_r_10": dict(_VIT_B16, num_tasks=10, epochs=50),
    "imagenet_r_20": dict(_VIT_B16, num_tasks=20, epochs=50),
    "domainnet_5": dict(_VIT_B16, num_tasks=5, epochs=5, rank=30),
}
IMAGE_BENCHMARKS = ("cifar100_10", "imagenet_r_5", "imagenet_r_10", "imagenet_r_20", "domainnet_5")
BENCHMARKS = tuple(_BENCH)
# Ten plays across the Folio's three genres; two per task by default (five tasks).
DEFAULT_PLAYS = (
    "tempest",
    "midsummer_nights_dream",
    "merchant_of_venice",
    "twelfth_night",
    "richard_iii",
    "henry_v",
    "romeo_and_juliet",
    "hamlet",
    "macbeth",
    "othello",
)


def build(arg, *, comparison, benchmark):
    """``arg``: ``smoke``, ``method=<name>|all|every``, ``benchmark=<name>``, ``seeds=<count>``,
    ``search=<trials>`` (0: the configured values, no search), ``head=<masked|aligned|prototype>``
    (default: the benchmark's), ``compare_heads`` (the head becomes a dimension of the validation
    search over masked and aligned; with ``search=0`` the heads at the configured values are
    compared on validation)."""
    arg = parse_arg(
        arg,
        smoke=False,
        method="all",
        benchmark=benchmark,
        seeds=1,
        search=0,
        head="",
        compare_heads=False,
    )
    if arg.benchmark not in BENCHMARKS:
        raise ConfigError(
            f"config arg benchmark={arg.benchmark!r} is invalid: allowed values are "
            + ", ".join(BENCHMARKS)
        )
    if arg.method not in ("all", "every") and arg.method not in METHODS:
        raise ConfigError(
            f"config arg method={arg.method!r} is invalid: allowed values are all, every, "
            + ", ".join(METHODS)
        )
    if arg.seeds < 1:
        raise ConfigError(f"config arg seeds={arg.seeds} is invalid: must be >= 1")
    if arg.search < 0:
        raise ConfigError(f"config arg search={arg.search} is invalid: trials per method, >= 0")
    b = _BENCH[arg.benchmark]
    c = ml_collections.ConfigDict()
    c.experiment = "continual"
    c.seed = 0
    c.seeds = tuple(range(arg.seeds))
    # all: this config's comparison; every: all eight methods (the sweep); else one method
    c.methods = {"all": tuple(comparison), "every": METHODS}.get(arg.method, (arg.method,))

    c.data = ml_collections.ConfigDict()
    c.data.benchmark = arg.benchmark
    c.data.num_tasks = b.get("smoke_tasks", 3) if arg.smoke else b["num_tasks"]
    c.data.batch_size = b.get("batch_size", 64)
    # validation rows per class carved from each task's training rows (used by the search only;
    # experiments/common/continual_search.validation_stream lists the sizes per benchmark)
    c.data.valid_fraction = 0.15
    # long_stream only (specs §2 (4)): classes per task, input dim, shared subspace, sizes
    c.data.classes_per_task = 5
    c.data.dim = 64
    c.data.subspace_dim = 32
    c.data.train_per_class = 100
    c.data.test_per_class = 50
    c.data.separation = 6.0  # norm of the class means (within-class sd 1 per subspace dim)
    # shakespeare_plays only: plays (classes), plays per task, passage length (characters, then
    # MiniLM word pieces; shorter passages are dropped) and passages per play (train / test)
    c.data.plays = DEFAULT_PLAYS
    c.data.plays_per_task = 2
    c.data.passage_chars = 320
    c.data.seq_len = 64
    if arg.benchmark == "shakespeare_plays":
        c.data.train_per_class = 60 if arg.smoke else 200
        c.data.test_per_class = 30 if arg.smoke else 60
    # training images per class for the tasks (the base session uses all its images: split_mnist
    # MNIST 0-4, mnist_cil the 60,000 Fashion-MNIST images)
    if arg.benchmark in ("split_mnist", "mnist_cil"):
        c.data.train_per_class = 200 if arg.smoke else 1000
    image = arg.benchmark in IMAGE_BENCHMARKS
    if image:  # the pre-trained ViT benchmarks: prepared TFDS data, read on demand
        c.data.data_dir = ""  # TFDS's data directory ("": TFDS's default, ~/tensorflow_datasets)
        c.data.shuffle_classes = False  # PyCIL's class order: shuffled by the seed, or ascending
        c.data.classes_per_task = 2 if arg.smoke else 0  # 0: the benchmark's (C / num_tasks)
        c.data.batch_size = 8 if arg.smoke else b["batch_size"]

    c.model = ml_collections.ConfigDict()
    c.model.name = b["model"]
    c.model.pretrain_steps = min(b["pretrain"], 100) if arg.smoke else b["pretrain"]
    if b["model"] == "mlp":
        c.model.features = b["features"]
    if b["model"] == "vit":  # 28x28 MNIST: 16 patches of 7x7
        c.model.vit = ml_collections.ConfigDict(
            dict(patch=7, dim=64, depth=4, heads=4, mlp_dim=128)
        )
    if b["model"] == "minilm":
        c.model.first_layer = 4  # layers 4-5 adapted; 0-3 frozen and cached
    if image:  # google/vit-base-patch16-224-in21k as save_pretrained writes it (safetensors)
        c.model.checkpoint = ""
        # layers under nn.scan (one compiled layer); False unrolls them (XLA's cost analysis
        # counts a scanned layer once: experiments/bench/paper_scale.py costs the unrolled model)
        c.model.scan_layers = True

    c.adapter = ml_collections.ConfigDict()
    c.adapter.rank = b.get("rank", 4)
    c.adapter.alpha = 8.0
    c.adapter.targets = b.get("targets", _MLP_TARGETS)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = b.get("learning_rate", 3e-3)
    c.optim.grad_clip = 1.0

    c.schedule = ml_collections.ConfigDict()
    c.schedule.steps_per_task = min(30, b["steps"]) if arg.smoke else b["steps"]
    # epochs over each task's training images (0: steps_per_task steps), as InfLoRA counts them
    c.schedule.epochs_per_task = 0 if arg.smoke else b.get("epochs", 0)
    if image and arg.smoke:
        c.schedule.steps_per_task = 3

    c.method = ml_collections.ConfigDict()
    c.method.memory_threshold = 0.97  # GPM energy threshold (inflora, gpm_lora, gr_lora)
    # examples per task whose layer inputs build the memories (MiniLM: 64 tokens each)
    c.method.memory_examples = b.get("memory_examples", 512)
    c.method.o_lora = ml_collections.ConfigDict()
    c.method.o_lora.lambda_orth = 0.5
    c.method.saber = ml_collections.ConfigDict()
    c.method.saber.shared_threshold = 0.95
    c.method.saber.specific_threshold = 0.99
    c.method.saber.lambda_align = 1.0
    c.method.saber.gamma = 0.5
    c.method.saber.min_weight = 0.25
    c.method.saber.shared_mode = "balanced"
    c.method.saber.energy_strength = 4.0  # κ of the direction-wise balancing (0: spec literal)
    c.method.saber.recalibrate_steps = 100  # head refit after recomposition (0: none)
    c.method.gr_lora = ml_collections.ConfigDict()
    c.method.gr_lora.recycle_scale = 1.0
    c.method.gr_lora.lambda_local = 0.5
    c.method.gr_lora.lambda_global = 0.5
    c.method.gr_lora.ood_batch = b.get("ood_batch", 64)  # synthetic OOD points per step

    # the validation search (experiments/common/continual_search.py): trials per method, its seed
    c.search = ml_collections.ConfigDict(dict(trials=arg.search, seed=0))
    # heads compared on validation with every trial (empty: config.head only); prototype lost to
    # aligned for 6 of 7 methods on digits_cil's validation (docs/papers/p01_saber.md), so it is compared only
    # when asked: --config.search.heads="('masked','aligned','prototype')"
    c.search.heads = ("masked", "aligned") if arg.compare_heads else ()
    # the classifier head: masked (trained on the current task's classes only: the method as
    # it is), aligned (continual.AlignedHead, SLCA: refit on Gaussian pseudo-features of all seen
    # classes after each task) or prototype (continual.PrototypeHead: class means, closed form),
    # the last two through continual.with_head; default: the benchmark's (above); :head=<name>
    c.head = arg.head or b.get("head", "aligned")
    c.method.heads = ml_collections.ConfigDict()
    c.method.heads.shrinkage = 0.1  # of the per-class feature covariances
    c.method.heads.align_steps = 200
    c.method.heads.align_learning_rate = 1e-2
    c.method.heads.align_per_class = 64  # pseudo-features per class and step
    c.method.heads.metric = "euclidean"  # prototype: euclidean | cosine | lda
    c.method.heads.ridge = 1e-2  # lda only
    c.method.heads.drift = True  # move old class means along the features' drift (SDC)
    c.method.heads.drift_bandwidth = 0.5

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 256

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.max_to_keep = 1

    c.log = ml_collections.ConfigDict()
    c.log.every = 10 if arg.smoke else 50
    c.log.progress = True
    c.parallel = ml_collections.ConfigDict()
    c.parallel.distributed = False  # several processes/hosts: see experiments.common.sharding
    c.train = train_section()  # options of the shared loop: skip_nonfinite
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    c.profile = profile_section()  # start_step, num_steps: a trace by flag
    return c
