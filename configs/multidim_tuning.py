r"""P12 data-driven tuning of p tied regularisation weights from N instances (specs §12 (4)).

Instance families: ``group`` — the synthetic weighted-group-lasso distribution of the spec (d = 40
in G = 8 groups of 5, group g active with probability π_g, n_train = n_val = 50, σ = 1);
``diabetes`` — real data: sklearn's diabetes set, 8 of its features (sex and s2 dropped, so that
G = 8) each expanded into a 5-function cubic spline group (``SplineTransformer``), an instance
being a random subset of 100 of the 442 patients split 50/50; ``fused`` — the synthetic
weighted-fused-lasso variant (d = 41, 40 edges in 8 blocks of varying jump density). For each
p ∈ {1, 2, 4, 8} (tied weight blocks) the weights are learned on N instances by the scalar grid
(p = 1), random search + coordinate refinement (p > 1) and Optuna TPE (the peer, at ``tpe_ps``),
all with the same budget of candidate evaluations; the true risk is the mean validation loss on
``num_test`` fresh instances. Reported: generalisation gap (true − empirical risk of α̂) and
excess risk (true risk of α̂ − that of the class's oracle α*, tuned on the fresh instances with
``oracle_budget`` evaluations) against N. ``chicago`` — a real fused-lasso family: the true
β of an instance is a standardised window of 41 weekly means (from the first Monday of March) of
one Chicago 'L' station's daily entries in one year (``lowrank_jax.data.load_chicago``,
``lowrank_jax.tuning.signal_banks.weekly_windows``: 20 stations × 2001–2015 = 300 signals), observed
through the same Gaussian design and noise as ``fused``
(``tuning.synthetic.sample_signal_instances``; fresh instances share the 300 signals, not the design
or noise); the holidays (Memorial Day, July 4, Labor Day, Thanksgiving) fall in the same weeks every
year, so the jump density varies along the index. See ``experiments/multidim_tuning.py``.

Commands (each produces one table of ``docs/papers/p12_multidim_tuning.md``; ``nice -n 10`` on the shared machine)::

    python -m experiments.train --config=configs/multidim_tuning.py --workdir=runs/multidim_tuning
    python -m experiments.train --config=configs/multidim_tuning.py:parts=fused \
        --config.eval.num_reps=4 --config.data.num_test=500 --config.model.fused_num_iters=400 \
        --workdir=runs/multidim_tuning_fused
    python -m experiments.train --config=configs/multidim_tuning.py:parts=chicago \
        --config.eval.num_reps=4 --config.data.num_test=500 --workdir=runs/multidim_tuning_chicago

The default (group + diabetes) is the **measured, reduced** grid: budget 100 evaluations per
tuner instead of 3,000 random candidates, 6 repetitions instead of 30, N ≤ 200, 1,000 fresh
instances instead of 3,000; 38 min wall on the 2-core machine at load 10–13 (the page's rerun of
2026-12-05). The fused and chicago runs are further reduced (4 repetitions, 500 fresh instances;
fused also 400 FISTA iterations): 4 and 5 min wall at load ~1 (the same reruns). ``:smoke`` ~30 s
of CPU. ``:spec`` is the spec's budget (3,000 evaluations per tuner, the oracle 9,000, 30
repetitions, N up to 500, 3,000 fresh instances): **not run** — about 100 CPU-hours for the four
families (13 per group-lasso family, 38 per fused one), estimated from the measured per-cell
timings in ``docs/notes/p11_p12_sel.md``.

The generalisation bound next to the measured gaps (``lowrank_jax.tuning.bounds``) is a
reconstruction (Warren's component count + Mohri et al.'s uniform convergence, every constant
explicit), not the paper's bound, whose constants are not public.
Measured results, with the commands that produced them: ``docs/papers/p12_multidim_tuning.md``; each
trend check's outcome: ``docs/papers/status.toml`` (P12), rendered into that page's verdict. Earlier
tables: ``docs/notes/p12_tuning.md``.

``arg``: ``"smoke"``, ``"spec"``; ``parts=group+diabetes+fused+chicago`` (``+``-separated)
selects the families (default ``group+diabetes``).
"""

import ml_collections

from configs.common import parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"spec"``, ``"parts=group+diabetes+fused+chicago"``, comma-separated."""
    arg = parse_arg(arg, smoke=False, spec=False, parts="group+diabetes")
    s, full = arg.smoke, arg.spec
    c = ml_collections.ConfigDict()
    c.experiment = "multidim_tuning"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.parts = tuple(arg.parts.split("+"))
    c.data.ns = (5, 10) if s else (5, 10, 20, 50, 100, 200) + ((500,) if full else ())
    c.data.num_test = 64 if s else 3000 if full else 1000  # fresh instances: the true risk
    c.data.n_train = 50
    c.data.n_val = 50
    c.data.noise = 1.0
    c.data.active_probs = (0.9, 0.8, 0.5, 0.3, 0.1, 0.1, 0.05, 0.05)  # group family (spec)
    c.data.fused_features = 41
    c.data.jump_probs = (0.4, 0.2, 0.1, 0.05, 0.4, 0.2, 0.1, 0.05)  # fused family, per edge block
    c.data.diabetes_drop = ("sex", "s2")
    c.data.spline_knots = 3  # 3 knots, degree 3 -> 5 spline functions per feature
    c.data.chicago_weeks = 41  # Chicago windows: d weekly means from the first Monday of March
    c.data.chicago_start = "03-01"

    c.model = ml_collections.ConfigDict()
    c.model.ps = (1, 2) if s else (1, 2, 4, 8)  # tied weight blocks
    c.model.num_iters = 40 if s else 150  # FISTA iterations, group lasso
    c.model.fused_num_iters = 80 if s else 600  # the fused problem is worse conditioned
    c.model.ridge = 1e-3  # (ρ/2)‖β‖² for uniqueness (spec: optional)
    c.model.chunk_size = 256  # instances per jitted call beyond which calls are chunked

    c.tune = ml_collections.ConfigDict()
    c.tune.budget = 8 if s else 3000 if full else 100  # evaluations per tuner (same for all)
    c.tune.oracle_budget = 16 if s else 9000 if full else 300  # α*_p, on the fresh instances
    c.tune.low = 1e-3
    c.tune.high = 10.0
    c.tune.refine_fraction = 0.5
    c.tune.num_points = 4
    c.tune.tpe_ps = (2,) if s else (8,)  # TPE (Optuna) runs at these p

    c.eval = ml_collections.ConfigDict()
    c.eval.num_reps = 2 if s else 30 if full else 6
    c.eval.bound_delta = 0.05  # failure probability of the pseudo-dimension gap bound

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True  # finished cells in <workdir>/cells are read back

    c.log = ml_collections.ConfigDict()
    c.log.progress = not s
    return c
