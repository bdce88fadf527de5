r"""P19 TPV and JBR pruning: the three small CPU experiments of §19 (4).

(b) JBR: an MLP 64-256-256-10 trained on sklearn digits (5 seeds), hidden neurons pruned to 90%
in 18 steps without fine-tuning by each criterion (random, L1, Taylor, Jacobian with labels,
JBR with confident pseudo-labels, exact TPV from per-example Jacobians); test accuracy per step.
(a) Stability: one-hidden-layer students of widths {4, 64, 256} on linear-Gaussian and
ReLU-teacher data, d = 10, n_train ∈ {10, 100, 1000}: TPV_train / TPV_test for quantisation
(σ_q² Tr H_eff) and label noise (R refits); a reduced version of the spec's grid, sized for a
loaded shared CPU. (c) Model selection: digits with 30% label noise,
weight decay × label smoothing grid; Spearman correlation of training-set label-noise TPV with
the test loss. (b') ``parts=pruning_cnn``: the pruning study of (b) on a small CNN (conv 3×3
16 and 32 channels, each with ReLU and 2×2 max-pool, dense 64, head) trained on 10,000 real MNIST
images (800 Adam steps); its 112 conv channels and dense units ranked globally by the same
criteria code, 90% in 18 steps, no fine-tuning, 5 seeds, accuracy on the first 2,000 MNIST test
images. See ``experiments/tpv_pruning.py``.

Command::

    python -m experiments.train --config=configs/tpv.py --workdir=runs/tpv

Runtime: about 35 minutes on a 2-core CPU shared with ~25 other processes; ``:smoke`` a few
minutes there. Measured results, with the commands that produced them: ``docs/papers/p19_tpv.md``;
each trend check's outcome: ``docs/papers/status.toml`` (P19), rendered into that page's verdict.

CNN command (51 minutes wall, 23.6 CPU-minutes, under ``nice -n 10`` on the 2-core CPU loaded
by other jobs)::

    python -m experiments.train --config=configs/tpv.py:parts=pruning_cnn --workdir=runs/tpv_cnn

Its measured results: the same page.

``arg``: ``"smoke"``; ``parts=pruning+stability+selection`` picks the parts (``pruning_cnn``
too; it is not in the default).
"""

import ml_collections

from configs.common import hardware_section, parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"parts=pruning+stability+selection"``, comma-separated."""
    arg = parse_arg(arg, smoke=False, parts="pruning+stability+selection")
    c = ml_collections.ConfigDict()
    c.experiment = "tpv_pruning"
    c.seed = 0
    c.parts = tuple(arg.parts.split("+"))

    c.data = ml_collections.ConfigDict()
    c.data.num_test = 500  # digits held out for test accuracy / loss
    c.data.batch_size = 64

    c.model = ml_collections.ConfigDict()
    c.model.features = (64, 64) if arg.smoke else (256, 256)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-3

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 150 if arg.smoke else 1000

    c.pruning = ml_collections.ConfigDict()
    c.pruning.num_seeds = 2 if arg.smoke else 5
    c.pruning.target_ratio = 0.9
    c.pruning.steps = 6 if arg.smoke else 18
    c.pruning.num_batches = 4 if arg.smoke else 10  # N_batchs of the scoring set
    c.pruning.confidence = 0.9  # JBR keeps pseudo-labels with max softmax above this
    c.pruning.tpv_examples = 64 if arg.smoke else 128  # inputs of exact TPV
    c.pruning.tpv_chunk = 32  # per-example Jacobians formed at once by exact TPV
    c.pruning.criteria = ("random", "l1", "taylor", "jacobian", "jbr", "exact_tpv")
    c.pruning.report_at = (0.45, 0.6, 0.7, 0.8, 0.85, 0.9)  # sparsity columns of the table

    # parts=pruning_cnn: conv 3x3 (16, 32 channels, 2x2 max-pool) + dense 64 on an MNIST subset.
    c.cnn = ml_collections.ConfigDict()
    c.cnn.channels = (4, 8) if arg.smoke else (16, 32)
    c.cnn.features = (16,) if arg.smoke else (64,)
    c.cnn.num_train = 1000 if arg.smoke else 10000  # MNIST training images (per-seed subset)
    c.cnn.num_test = 500 if arg.smoke else 2000  # the first images of the MNIST test split
    c.cnn.num_steps = 100 if arg.smoke else 800  # Adam steps, batch data.batch_size
    c.cnn.eval_chunk = 500  # test images per forward pass

    c.stability = ml_collections.ConfigDict()
    c.stability.teachers = ("linear", "relu")
    c.stability.dims = (10,)
    c.stability.widths = (4, 64) if arg.smoke else (4, 64, 256)
    c.stability.n_trains = (10, 100) if arg.smoke else (10, 100, 1000)
    c.stability.num_test = 500
    c.stability.steps = 100 if arg.smoke else 300
    c.stability.bits = 8
    c.stability.sigma = 0.01  # label-noise sd of the refits
    c.stability.refits = 5
    c.stability.refit_steps = 50 if arg.smoke else 100

    c.selection = ml_collections.ConfigDict()
    c.selection.label_noise = 0.3
    c.selection.weight_decays = (0.0, 1e-2) if arg.smoke else (0.0, 1e-2, 1e-1)
    c.selection.smoothings = (0.0, 0.2) if arg.smoke else (0.0, 0.3)
    c.selection.sigma = 0.1
    c.selection.refits = 3 if arg.smoke else 5
    c.selection.refit_steps = 50 if arg.smoke else 100
    c.selection.tpv_examples = 200 if arg.smoke else 300

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True  # finished cells in <workdir>/cells are read back

    c.log = ml_collections.ConfigDict()
    c.log.progress = not arg.smoke
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    return c
