r"""P3 LoRA forgetting as drift of mean-field attention token dynamics (specs §3 (4)).

Synthetic grid: ``n = 64`` tokens uniform on ``S^{d-1}``, ``d ∈ {3, 8}``, ``β = 1``, ``Q = K = I``,
``V = diag(1, 1-g, ..., 1-g)`` with gap ``g ∈ {0.05, 0.2}``; perturbations of norm
``ε ∈ logspace(-3, 0, 13)``: rank-1 ``ΔV = ε uuᵀ`` aligned (``u = e₁``) or gap-crossing
(``u`` = second eigenvector), random rank-2 and full-rank ``ΔV``, and a random rank-2 ``ΔK``
(the comparators of specs §3 (5)); RK4, ``dt = 0.05``, ``T = 60`` on the sphere and ``T = 20``
for the unnormalised ``R^d`` variant; 3 draws of the initial tokens. Measured: ``D(T, ε)``,
``T_dev(ε, δ = 0.1)``, ``W₂`` at ``T``, heat maps of ``D(t, ε)``.

Real weights: the per-head ``Q_h, K_h`` (32 × 384) and OV circuit ``V_h = (W_V^h W_O^h)ᵀ``
(384 × 384) of pretrained all-MiniLM-L6-v2 (every head of layers 0 and 5), started from the
layer's actual inputs on Shakespeare passages (first 32 tokens, normalised onto the sphere),
``β = mean‖x‖² / √32`` (the head's real logit scale); rank-1 ``ΔV`` along the top
("aligned") or second ("gap-crossing") eigenvector of ``V_h``'s symmetric part, with
``ε / gap ∈ {0.1, ..., 10}``; ``T = 20`` (a 6-layer model is depth ~6).

Command::

    python -m experiments.train --config=configs/attention_dynamics.py --workdir=runs/attention_dynamics

Runtime: 26 min on the 2-core CPU shared with other jobs (load average 15-23): synthetic grid
3 min, 24 MiniLM heads 23 min; ``:smoke`` (sphere flow only, one MiniLM head) about 20 s of CPU.
Expected result (specs §3): (a) ``T_dev`` affine in ``log 1/ε`` with ``R² > 0.9``; (b) a jump of
``D(T, ε)`` at ``ε ≈ g`` for gap-crossing, not aligned, perturbations; (c) for ``ε < g``, ``D``
grows then plateaus with depth. Measured results, with the commands that produced them:
``docs/papers/p03_mean_field_attention.md``; each trend check's outcome: ``docs/papers/status.toml``
(P3), rendered into that page's verdict.

``arg``: ``"smoke"``; ``minilm=false`` skips the MiniLM part.
"""

import ml_collections

from configs.common import parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"minilm=true|false"``, comma-separated."""
    arg = parse_arg(arg, smoke=False, minilm=True)
    c = ml_collections.ConfigDict()
    c.experiment = "attention_dynamics"
    c.seed = 0

    c.data = ml_collections.ConfigDict()  # the synthetic grid
    c.data.num_tokens = 16 if arg.smoke else 64
    c.data.dims = (3,) if arg.smoke else (3, 8)
    c.data.gaps = (0.2,) if arg.smoke else (0.05, 0.2)
    c.data.num_eps = 5 if arg.smoke else 13
    c.data.eps_range = (1e-3, 1.0)
    c.data.random_rank = 2
    c.data.num_seeds = 1 if arg.smoke else 3
    c.data.models = ("sphere",) if arg.smoke else ("sphere", "unnormalised")

    c.model = ml_collections.ConfigDict()  # the flow and its integration
    c.model.beta = 1.0
    c.model.dt = 0.05
    c.model.t_max = 6.0 if arg.smoke else 60.0  # sphere
    c.model.t_max_unnormalised = 5.0 if arg.smoke else 20.0
    c.model.record_every = 4  # records every 0.2 time units

    c.minilm = ml_collections.ConfigDict()
    c.minilm.enabled = arg.minilm
    c.minilm.layers = (5,) if arg.smoke else (0, 5)
    c.minilm.heads = (0,) if arg.smoke else tuple(range(12))
    c.minilm.plays = ("hamlet", "tempest")  # one passage of each
    c.minilm.passage_chars = 256
    c.minilm.num_tokens = 8 if arg.smoke else 32
    c.minilm.ratios = (0.5, 2.0) if arg.smoke else (0.1, 0.25, 0.5, 0.8, 1.25, 2.0, 4.0, 10.0)
    c.minilm.t_max = 2.0 if arg.smoke else 20.0

    c.eval = ml_collections.ConfigDict()
    c.eval.delta = 0.1  # deviation threshold of T_dev

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True  # finished cells in <workdir>/cells are read back

    c.log = ml_collections.ConfigDict()
    c.log.progress = not arg.smoke
    return c
