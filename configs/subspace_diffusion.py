r"""Diffusion sample complexity on a union of low-dimensional subspaces (P7, kernel-score sampler).

The kernel-score diffusion sampler (``lowrank_jax.generative.sample_kernel_diffusion``:
probability-flow ODE, exponential integrator, 100 geometric steps, early stopping at
``σ(t₀) = n^{-1/max(k,2)}``, Tweedie step) against the empirical measure, a Gaussian KDE in the
ambient dimension (bandwidth by held-out likelihood, and Silverman's rule) and a learned MLP score
(denoising score matching, qualitative, on a few cells). W₁ by exact optimal transport (POT) to
fresh true samples, next to the finite-sample floor W₁(true, true'); slopes of log W₁ vs log n.

* synthetic: D ∈ {10, 50, 200}, three random subspaces of dimensions (k, k, k-1), k ∈ {1..4},
  laws uniform-cube / Laplace / two-point mixture, weights (0.5, 0.3, 0.2);
* MNIST: each class projected onto its own top-k right singular vectors (uncentred: an exact union
  of 10 linear k-dim subspaces with real digits inside), in pixel space (D = 784) and isometrically
  embedded in D = 64 (the same point cloud: only the ambient dimension differs).

Command::

    nice -n 10 python -m experiments.train --config=configs/subspace_diffusion.py \
        --workdir=runs/subspace_diffusion

Runtime: see ``docs/papers/p07_subspace_diffusion.md`` (measured on a loaded 2-core CPU); ``:smoke``
about a minute. Rerunning resumes: finished cells are read back from ``<workdir>/cells``.

Sizes (chosen for the time budget of a 2-core CPU shared with ~8 jobs): n ∈ {25, …, 400}
(synthetic) and {100, …, 800} (MNIST, k = 2); 50 ODE steps; m = 500 generated samples against 500
fresh true samples, so the floor W₁(true, true') is reached when n ≳ m and slopes flatten there
(reported next to the floor).

Expected result (specs.md §7): diffusion slopes ≈ -1/max(k,2) (± 0.1), the same at D = 10 and
D = 200, while the full-dimensional KDE degrades with D. What was measured is in ``results.md``
and in the notes, reproduced or not.

``arg``: ``"quick"`` (D ∈ {10, 200}, k ∈ {1, 2, 4}, n ∈ {25, …, 200}, m = 300, 30 steps, MNIST
n ∈ {100, 200, 400}: the measured run of the notes, made on a heavily loaded machine) or
``"smoke"`` (D ∈ {5, 20}, k ∈ {1, 2}, three small n, MNIST k = 2 in D = 64, tiny MLP).
"""

import ml_collections

from configs.common import hardware_section, parse_arg, profile_section, train_section


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"quick"`` or nothing."""
    arg = parse_arg(arg, smoke=False, quick=False)
    c = ml_collections.ConfigDict()
    c.experiment = "subspace_diffusion"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.dims = (5, 20) if arg.smoke else (10, 50, 200)
    c.data.ks = (1, 2) if arg.smoke else (1, 2, 3, 4)
    c.data.weights = (0.5, 0.3, 0.2)
    c.data.laws = ("uniform", "laplace", "two_point")
    c.data.sizes = (25, 50, 100) if arg.smoke else (25, 50, 100, 200, 400)
    c.data.mnist_dims = (64,) if arg.smoke else (64, 784)  # () to skip MNIST
    c.data.mnist_ks = (2,)
    c.data.mnist_sizes = (50, 100) if arg.smoke else (100, 200, 400, 800)
    c.data.valid_size = 100 if arg.smoke else 300  # held-out points for the KDE bandwidth

    c.model = ml_collections.ConfigDict()
    c.model.num_steps = 30 if arg.smoke else 50
    c.model.stochastic = False  # probability-flow ODE (True: reverse SDE)
    c.model.tweedie = True
    c.model.sigma_scale = 1.0  # σ(t₀) = sigma_scale · n^(-1/max(k,2)) (theory, not tuned)
    c.model.horizon_scale = 1.0  # T = horizon_scale · log n
    c.model.chunk_size = 2048  # training points per block of the kernel score
    c.model.clip = 0.0  # score clip C (0: off)
    c.model.kde_bandwidths = 9  # grid size: RMS radius · geomspace(1e-4, 1)
    # Learned score (qualitative): (source, k, D, n) cells; source "syn" or "mnist".
    c.model.mlp_cells = (
        (("syn", 2, 20, 100),) if arg.smoke else (("syn", 2, 10, 400), ("syn", 2, 200, 400))
    )
    c.model.mlp_features = (32, 32) if arg.smoke else (256, 256, 256)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-3

    c.schedule = ml_collections.ConfigDict()
    c.schedule.mlp_steps = 60 if arg.smoke else 1500
    c.schedule.batch_size = 64 if arg.smoke else 128

    c.eval = ml_collections.ConfigDict()
    c.eval.num_samples = 200 if arg.smoke else 500  # m generated vs m fresh true samples
    c.eval.slope_tolerance = 0.1
    c.eval.max_d_ratio = 1.25  # "independent of D": W₁(D_max)/W₁(D_min) at the largest n

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True

    c.log = ml_collections.ConfigDict()
    c.log.every = 20 if arg.smoke else 500
    if arg.quick:  # what fitted a 2-core CPU shared with ~8 jobs (load ~30) in ~30 minutes
        c.data.dims = (10, 200)
        c.data.ks = (1, 2, 4)
        c.data.sizes = (25, 50, 100, 200)
        c.data.mnist_sizes = (100, 200, 400)
        c.data.valid_size = 200
        c.model.num_steps = 30
        c.model.kde_bandwidths = 7
        c.model.mlp_cells = (("syn", 2, 10, 200), ("syn", 2, 200, 200))
        c.schedule.mlp_steps = 600
        c.eval.num_samples = 300
    c.train = train_section()  # options of the shared loop: skip_nonfinite
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    c.profile = profile_section()  # start_step, num_steps: a trace by flag
    return c
