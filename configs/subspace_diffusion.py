r"""Diffusion sample complexity on a union of low-dimensional subspaces (P7, kernel-score sampler).

The kernel-score diffusion sampler (``lowrank_jax.generative.sample_kernel_diffusion``:
probability-flow ODE, exponential integrator, 50 geometric steps, early stopping at
``σ(t₀) = n^{-1/max(k,2)}``) with and without its final Tweedie step, against the empirical
measure, a Gaussian KDE in the ambient dimension (bandwidth by held-out likelihood, and Silverman's
rule) and a learned MLP score (denoising score matching, learning rate tuned per D on a validation
draw). Data: D ∈ {10, 50, 200}, three random subspaces of dimensions (k, k, k-1), k ∈ {1..4}, laws
uniform-cube / Laplace / two-point mixture, weights (0.5, 0.3, 0.2); n ∈ {125, …, 4000}; W₁ by
exact assignment (POT) between m = 2000 generated and 2000 fresh true samples, per seed (3 seeds),
next to the floor W₁(true, true'); slopes of log(W₁ - floor) vs log n (specs.md §7).

Command (the spec's grid; 16 min wall on a 2-core CPU shared with three other jobs)::

    nice -n 5 python -m experiments.train --config=configs/subspace_diffusion.py \
        --workdir=runs/subspace_diffusion

``:reduced`` (a fallback for a busier machine; the full grid fitted): the same m, n, seeds and
MLP, on D ∈ {10, 200} for every k plus D = 50 for k = 2 (the D-test), i.e. 9 of the 12 (k, D)
sources, which come first in the full grid's order. Rerunning resumes: finished cells are read back
from ``<workdir>/cells``.

Expected result (specs.md §7): slopes ≈ -1/max(k,2) (± 0.1), W₁ independent of D, the
full-dimensional KDE degrading with D. What was measured is in ``results.md``, reproduced or not.

``:resolve`` (the rate where the evaluation can resolve it): twice the evaluation samples,
m = 4,000 (the floor W₁(true, true') falls by 1.2-1.4×), on n ∈ {125, …, 1000} (n ≤ m/4), for
k ∈ {1, 2} (target -1/2) at D ∈ {10, 200}: the Tweedie sampler and the empirical measure only, no
MLP. A slope is read from the *resolved* cells only, those with W₁ ≥ ``eval.resolution`` × floor
(2: the excess over the floor at least the floor itself), and only where ≥ 3 of them span ≥ 4× in
n on every seed; elsewhere the rate is unresolved (inconclusive)::

    nice -n 10 python -m experiments.train --config=configs/subspace_diffusion.py:resolve \
        --workdir=runs/subspace_diffusion_resolve

``arg``: ``"reduced"``, ``"resolve"`` or ``"smoke"`` (D ∈ {5, 20}, k ∈ {1, 2}, three small n,
2 seeds, tiny MLP).
"""

import ml_collections

from configs.common import hardware_section, parse_arg, profile_section, train_section


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"reduced"``, ``"resolve"`` or nothing."""
    arg = parse_arg(arg, smoke=False, reduced=False, resolve=False)
    c = ml_collections.ConfigDict()
    c.experiment = "subspace_diffusion"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    ks, dims = ((1, 2), (5, 20)) if arg.smoke else ((1, 2, 3, 4), (10, 50, 200))
    # (intrinsic k, ambient D); ordered so that the :reduced grid comes first (cells resume)
    c.data.sources = tuple((k, d) for k in ks for d in (dims[0], dims[-1])) + tuple(
        (k, d) for k in sorted(ks, key=lambda k: k != 2) for d in dims[1:-1]
    )
    if arg.reduced:
        c.data.sources = c.data.sources[: 2 * len(ks) + 1]
    if arg.resolve:
        c.data.sources = tuple((k, d) for k in ks[:2] for d in (dims[0], dims[-1]))
    c.data.weights = (0.5, 0.3, 0.2)
    c.data.laws = ("uniform", "laplace", "two_point")
    c.data.sizes = (25, 50, 100) if arg.smoke else (125, 250, 500, 1000, 2000, 4000)
    if arg.resolve:
        c.data.sizes = c.data.sizes[:4]
    c.data.valid_size = 100 if arg.smoke else 300  # held-out points for the KDE bandwidth

    c.model = ml_collections.ConfigDict()
    c.model.num_steps = 20 if arg.smoke else 50
    c.model.stochastic = False  # probability-flow ODE (True: reverse SDE)
    c.model.sigma_scale = 1.0  # σ(t₀) = sigma_scale · n^(-1/max(k,2)) (theory, not tuned)
    c.model.horizon_scale = 1.0  # T = horizon_scale · log n
    c.model.chunk_size = 2048  # training points per block of the kernel score
    c.model.clip = 0.0  # score clip C (0: off)
    c.model.kde_bandwidths = 9  # grid size: RMS radius · geomspace(1e-4, 1)
    # Learned score: trained at (k, n) = (mlp_k, mlp_n) in every D of mlp_dims.
    c.model.mlp_k = 2
    c.model.mlp_n = 100 if arg.smoke else 1000
    c.model.mlp_dims = (5, 20) if arg.smoke else (10, 50, 200)
    if arg.resolve:
        c.model.mlp_dims = ()  # no learned score (the paper's estimator only)
    c.model.mlp_features = (32, 32) if arg.smoke else (256, 256, 256)
    c.model.mlp_learning_rates = (1e-3, 3e-3) if arg.smoke else (3e-4, 1e-3, 3e-3)
    # "eps": ε-network; "edm": EDM-preconditioned denoiser
    # (lowrank_jax.generative.baselines.dsm_loss)
    c.model.mlp_parameterisations = ("eps", "edm")

    c.optim = ml_collections.ConfigDict()  # the MLP's learning rate is model.mlp_learning_rates

    c.schedule = ml_collections.ConfigDict()
    c.schedule.mlp_steps = 40 if arg.smoke else 2000
    c.schedule.batch_size = 64 if arg.smoke else 128

    c.eval = ml_collections.ConfigDict()
    c.eval.num_samples = 200 if arg.smoke else 2000  # m generated vs m fresh true samples
    if arg.resolve:
        c.eval.num_samples = 4000 if not arg.smoke else 400
    # the samplers evaluated (subset of experiments.subspace_diffusion_report.METHODS)
    c.eval.methods = ("diffusion", "diffusion_no_tweedie", "empirical", "kde_cv", "kde_silverman")
    if arg.resolve:
        c.eval.methods = ("diffusion", "empirical")
    # a cell resolves the rate when its W₁ >= resolution × the floor W₁(true, true')
    c.eval.resolution = 2.0
    c.eval.num_seeds = 2 if arg.smoke else 3  # training set, sampler noise and true samples
    c.eval.slope_tolerance = 0.1
    c.eval.max_d_ratio = 1.25  # "independent of D": W₁(D_max)/W₁(D_min)

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True

    c.log = ml_collections.ConfigDict()
    c.log.every = 20 if arg.smoke else 500
    c.train = train_section()  # options of the shared loop: skip_nonfinite
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    c.profile = profile_section()  # start_step, num_steps: a trace by flag
    return c
