r"""FP8 attention scales of the pretrained MiniLM against its max logit on real text (P14).

For every layer of all-MiniLM-L6-v2 (a real pretrained 6-layer BERT) the geometry-aware FP8
scale and the rank-aware, rank-agnostic and worst-case bounds on its attention logits are
computed from the weights (q/k biases folded in, ``fp8.diagnostics.attention_logit_report``) and
compared with the empirical max |logit| on Shakespeare passages. See ``experiments/fp8_minilm.py``.

Command::

    python -m experiments.train --config=configs/fp8_minilm.py --workdir=runs/fp8_minilm

Runtime: about 1 minute on a 2-core CPU; ``:smoke`` (8 passages of 64 tokens) about 20 s.
Measured results, with the commands that produced them: ``docs/papers/p14_fp8.md``; each trend
check's outcome: ``docs/papers/status.toml`` (P14), rendered into that page's verdict.
"""

import ml_collections

from configs.common import parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "fp8_minilm"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.num_passages = 8 if arg.smoke else 64  # Shakespeare passages
    c.data.passage_chars = 600
    c.data.max_len = 64 if arg.smoke else 128  # tokens

    c.policy = ml_collections.ConfigDict()
    c.policy.delta = 1e-6  # failure probability of the bound
    c.policy.fmt = "e4m3"
    c.policy.power_iters = 100  # cold-start power steps for σ per layer
    return c
