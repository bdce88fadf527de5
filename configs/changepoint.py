r"""P17 online low-rank Poisson change points: synthetic grid of §17 and NYC flights 2013.

Synthetic: ``p × L`` count streams with a rank-2 intensity (about 2 events per cell), a
multiplicative AR(1) factor (``ρ ∈ {0, 0.5}``), and changes of Frobenius size ``κ`` at ``τ = 500``
(``local``: a rank-1 bump on a 10×10 block; ``global``: a rank-1 reweighting of every cell).
Every detector in ``model.methods`` (low-rank scan with adaptive SVT window estimates, the
Frobenius scan, Poisson Page-CUSUM on totals, entrywise CUSUM; the fixed-rank scan on request)
gets its threshold at the spec's horizon ``T = 3,000`` by simulation from a null model fitted to a
training stretch (``lowrank_jax.changepoint.simulate``); the SVT level's constant ``c_τ`` comes
from a block bootstrap of the stretch. False-alarm rates on ``null_reps`` fresh null streams of
length ``T`` at α ∈ {0.01, 0.05, 0.1}; detection and delays against κ (runs end ``post_change``
after the change); the window scales ``J`` of ``model.num_scales_grid`` compared. Flights: daily
carrier × hour counts, calibrated on January–March, monitored April–December with restarts after
each alarm; FOCuS (changepoint-online) on totals and ruptures' PELT with a Poisson cost side by
side. See ``experiments/changepoint.py``.

Command::

    python -m experiments.train --config=configs/changepoint.py --workdir=runs/changepoint

Runtime: the defaults (the spec's sizes: 500 simulated calibration and 500 null streams of
3,000 observations per setting, 200 change streams per cell) need about 4 million simulated
observations per (ρ, J), of the order of hours on a 2-core CPU (measured: 0.6–0.8 CPU-ms per
observation for the four detectors and the sampler under load); the run is cell by cell
(``CellStore``), so a rerun of the same command resumes. What was run, with its sizes and times:
``docs/papers/p17_changepoint.md``. ``:smoke`` (p = L = 8, short streams, no flights) takes a few
minutes. Each trend check's outcome: ``docs/papers/status.toml`` (P17), rendered into that page's
verdict.

``arg``: ``"smoke"``; ``flights=false`` skips the flights part.
"""

import ml_collections

from configs.common import parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"flights=true|false"``, comma-separated."""
    arg = parse_arg(arg, smoke=False, flights=True)
    c = ml_collections.ConfigDict()
    c.experiment = "changepoint"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.p = 8 if arg.smoke else 30
    c.data.num_cells = 8 if arg.smoke else 30
    c.data.rank = 2
    c.data.mean = 2.0
    c.data.block = 4 if arg.smoke else 10
    c.data.rhos = (0.0, 0.5)
    c.data.sigma = 0.2  # sd of the AR(1) log-intensity factor
    # effective length n (1 - rho) / (1 + rho) >= horizon / alpha = 10^4 at rho = 0.5: the bootstrap
    # must resolve a per-step tail near alpha / horizon
    c.data.train_len = 200 if arg.smoke else 30000
    c.data.horizon = 150 if arg.smoke else 3000  # the spec's null runs (thresholds at this T)
    c.data.tau = 60 if arg.smoke else 500  # change time of the change runs
    c.data.post_change = 60 if arg.smoke else 500  # change runs end at tau + post_change
    c.data.kinds = ("local", "global")
    c.data.kappas = (4.0, 8.0) if arg.smoke else (3.0, 6.0, 12.0)
    c.data.null_reps = 60 if arg.smoke else 500  # MC s.e. of a 0.05 rate: 0.0097
    c.data.change_reps = 20 if arg.smoke else 200

    c.model = ml_collections.ConfigDict()  # the detectors
    c.model.rank = 2  # r of b_{t,w}; the fixed rank of `lowrank_fixed`
    c.model.max_rank = 4  # the most directions an SVT window estimate may keep (lowrank)
    c.model.svt_calibrate = True  # c_tau of tau_S from the training stretch (block bootstrap)
    c.model.svt_scale = 0.5  # c_tau when svt_calibrate is False
    c.model.num_scales = 4 if arg.smoke else 8  # windows 1..256 (half the post-change stretch)
    c.model.num_scales_grid = (2, 4) if arg.smoke else (5, 8)  # window scales compared
    c.model.scales_delays = True  # change runs at the other J too (kappas below)
    c.model.scales_kappas = (8.0,) if arg.smoke else (6.0,)
    c.model.methods = ("lowrank", "frobenius", "cusum_totals", "cusum_entrywise")
    c.model.alpha_stat = 0.05  # level inside log(t^2 (J+1)/alpha)
    c.model.power_iters = 1
    c.model.cusum_total_change = 0.05  # relative change the totals CUSUM is tuned to
    c.model.cusum_cell_change = 0.5  # relative change of every cell's CUSUM

    c.eval = ml_collections.ConfigDict()
    c.eval.alphas = (0.01, 0.05, 0.1)
    c.eval.alpha = 0.05  # level of the delay runs and the flights monitor
    c.eval.cal_streams = 60 if arg.smoke else 500  # simulated null streams per threshold
    c.eval.boot_streams = 100 if arg.smoke else 1000  # block bootstrap of c_tau, flights
    c.eval.block_len = 32  # moving-block bootstrap block = the longest window 2^J (synthetic)
    c.eval.chunk = 16  # observations per scan step
    c.eval.refit_cusum = True  # re-estimate the totals CUSUM's rate per bootstrap stream

    c.flights = ml_collections.ConfigDict()
    c.flights.enabled = arg.flights and not arg.smoke
    c.flights.train_days = 90  # January-March
    c.flights.rank = 3
    c.flights.num_scales = 5  # windows 1..32 (about a month)
    c.flights.max_rank = 5
    c.flights.block_len = 7  # whole weeks
    c.flights.restart_ref_days = 28  # reference stretch of a restarted detector
    c.flights.boot_streams = 200

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.note = "finished cells in <workdir>/cells/*.json (CellStore; reruns read them back)"

    c.log = ml_collections.ConfigDict()
    c.log.progress = not arg.smoke
    return c
