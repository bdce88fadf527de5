r"""SBVI rank discovery vs fixed-rank LoRA and AdaLoRA: teacher–student (P8, specs §8).

A frozen random tanh MLP 64-128-128-10 (the teacher) is the base model; the target network adds
``ΔW*_l`` of ranks (1, 4, 8) to its three kernels (strengths ``geomspace(1, .5)`` × the kernel's
spectral norm × 0.5); regression with noise 0.1 on 2,000 Gaussian inputs (500 more for validation,
1,000 for test). Methods: LoRA at ranks 1, 4, 8, 16 (Adam), AdaLoRA (``r = 16`` → average target
rank 4, cubic budget, orthogonality regulariser 0.1) and SBVI (``r_max = 16``, Gaussian ``q(σ)``
per mode by its Wasserstein flow, :func:`lowrank_jax.optim.scale_by_sbvi`) at T₀ = 0 (no
diffusion: a MAP flow), 1e-6 (the Bayesian temperature 2·noise²/(n·d_out)) and 1e-5, each with
the friction λ ∈ {5e-5, 1e-4, 2e-4} chosen on validation (seed 0); all adapt the three kernels
(the head's rank is capped at 10). 3 seeds.

Command::

    python -m experiments.train --config=configs/sbvi.py --workdir=runs/sbvi_flow

Runtime: 23 min wall on a 2-core CPU at load average ~20 (``:smoke`` ~1 min).
Measured results, with the commands that produced them: ``docs/papers/p08_sbvi.md``; each trend
check's outcome: ``docs/papers/status.toml`` (P8), rendered into that page's verdict.
"""

import ml_collections

from configs.common import hardware_section, parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "sbvi"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.num_train = 2000
    c.data.num_test = 1000
    c.data.num_valid = 500  # for choosing SBVI's friction (own random stream)
    c.data.noise = 0.1
    c.data.true_ranks = (1, 4, 8)
    c.data.delta_scale = 0.5
    c.data.batch_size = 200

    c.model = ml_collections.ConfigDict()
    c.model.num_inputs = 64
    c.model.features = (128, 128)
    c.model.num_outputs = 10

    c.adapter = ml_collections.ConfigDict()
    c.adapter.lora_ranks = (4,) if arg.smoke else (1, 4, 8, 16)
    c.adapter.r_max = 16
    c.adapter.adalora_target_rank = 4

    c.optim = ml_collections.ConfigDict()
    c.optim.lora_lr = 3e-3
    c.optim.adalora_lr = 3e-3
    c.optim.sbvi_lr = 1e-2
    c.optim.sbvi_factor_lr = 1e-2
    c.optim.sbvi_family = "gaussian"  # q(σ_i) = N(μ_i, s_i²); "langevin": one particle per mode
    c.optim.friction = 1e-4  # λ when run_cell is called without a tuned friction
    c.optim.friction_grid = (1e-4,) if arg.smoke else (5e-5, 1e-4, 2e-4)
    c.optim.friction_warmup = 0.5  # fraction of the steps
    c.optim.prune_start = 0.6  # fraction of the steps
    # T = 2·noise²/(num_train·num_outputs) = 1e-6 is the Bayesian posterior's temperature for the
    # mean-squared-error loss; T = 0 is the flow without diffusion.
    c.optim.temperature = 1e-6
    c.optim.temperatures = (0.0, 1e-6) if arg.smoke else (0.0, 1e-6, 1e-5)
    c.optim.prune_ratio = 0.1
    c.optim.prune_snr = 0.0
    c.optim.precond_max = 1e3  # bound of the σ preconditioner (Langevin noise sd ≤ √(2η·1e3·T))

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 300 if arg.smoke else 3000

    c.eval = ml_collections.ConfigDict()
    c.eval.num_seeds = 1 if arg.smoke else 3

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True  # finished cells in <workdir>/cells are read back, not recomputed
    c.log = ml_collections.ConfigDict()
    c.log.progress = False
    c.parallel = ml_collections.ConfigDict()
    c.parallel.distributed = False
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    return c
