r"""P9 limits of adaptation in multitask learning: a threshold-class mechanism simulator.

The theorem of P9 (Hanneke & Xu, arXiv 2601.20774) says that no algorithm that is not told how
the ``N`` source tasks relate to the target can match the *oracle* that pools exactly the useful
ones, for any number ``n`` of samples per task. A lower bound cannot be reproduced; this module
simulates the mechanism (``papers/specs.md`` §9 (4), a reconstruction):

* hypothesis class: thresholds ``h_t(x) = 1[x ≥ t]`` on ``[0, 1]``; ``h* = h_{1/2}``;
* target ``D``: ``x ~ U[0, 1]``, ``η(x) = ½ + ½ sign(x − ½)|2x − 1|^a`` with ``a = 1/β − 1``, so
  that ``P(h_t ≠ h*) = |t − ½|`` and the excess risk is (Bernstein exponent ``β``)
  ``E(t) = (2|t − ½|)^{a+1} / (2(a + 1))``;
* "good" sources have the target's distribution (transfer exponent ρ = 1); "decoy" sources share
  ``h*`` and the marginal but their ``η`` is flattened to ``½ ± margin`` on ``|x − ½| ≤ w``, so
  they carry almost no boundary information. With ``w = c · n^{−β/(2−β)}`` (the resolution of a
  single task's ERM) a decoy cannot be told apart from a good task by its own sample, while many
  decoys together drown the boundary signal of the good ones. That rescaling makes the ratio's
  n-independence hold by construction; a fixed ``w`` (``width=``) is the same instance at every
  ``n``, the control where it is measured;
* a hidden random subset of ``k`` of the ``N`` sources is good; the family is indexed by
  ``(k, c)`` and an adaptive method is judged by its worst-case ratio to the oracle.

Estimators (all weighted ERMs over the pooled sample, see :func:`threshold_estimates`):
``target_only``, ``pooled``, ``oracle`` (target + the good sources), ``agreement`` (sources whose
own ERM lies within ``z`` robust scales of the median), ``validation_prefix`` (sources ordered by
distance to the target's ERM, prefix size chosen on held-out target samples), ``inverse_variance``
(weights ``1 / ((t̂_i − t̂_pool)² + s²)``) and ``lepski`` (the largest prefix whose estimate stays
within ``C (n m)^{−β/(2−β)}`` of every smaller prefix's).

Everything is vectorised: one draw is a pure function of a PRNG key, ``vmap``-ed over draws
(:func:`simulate_threshold_family`); the same estimators run on real data (any 1-D score in
``[0, 1]`` with binary labels, e.g. a semi-synthetic MNIST construction).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ESTIMATORS",
    "decoy_width",
    "empirical_excess_risk",
    "group_pool",
    "rank_scores",
    "sample_pool_tasks",
    "sample_threshold_tasks",
    "simulate_threshold_family",
    "target_eta",
    "threshold_estimates",
    "threshold_excess_risk",
    "weighted_threshold_erm",
]

ESTIMATORS = (
    "target_only",
    "pooled",
    "oracle",
    "agreement",
    "validation_prefix",
    "inverse_variance",
    "lepski",
)


def _check_beta(beta: float) -> float:
    if not 0 < beta <= 1:
        raise ValueError(f"beta={beta} is invalid: the Bernstein exponent lies in (0, 1]")
    return 1.0 / beta - 1.0


def target_eta(x: jax.typing.ArrayLike, *, beta: float = 0.5) -> jax.Array:
    """``η(x) = P(y = 1 | x) = ½ + ½ sign(x − ½) |2x − 1|^{1/β − 1}`` (``β = ½``: ``η(x) = x``)."""
    a = _check_beta(beta)
    x = jnp.asarray(x)
    return 0.5 + 0.5 * jnp.sign(x - 0.5) * jnp.abs(2 * x - 1) ** a


def threshold_excess_risk(t: jax.typing.ArrayLike, *, beta: float = 0.5) -> jax.Array:
    """Closed-form target excess risk ``E(t) = (2|t − ½|)^{a+1} / (2(a+1))``, ``a = 1/β − 1``."""
    a = _check_beta(beta)
    return (2 * jnp.abs(jnp.asarray(t) - 0.5)) ** (a + 1) / (2 * (a + 1))


def decoy_width(n: int, *, c: float, beta: float = 0.5) -> float:
    """Decoy flat-zone half-width ``w = min(c n^{−β/(2−β)}, ½)`` (one task's ERM resolution)."""
    _check_beta(beta)
    if n < 1 or c < 0:
        raise ValueError(f"need n >= 1 and c >= 0; got n={n}, c={c}")
    return float(min(c * n ** (-beta / (2 - beta)), 0.5))


def sample_threshold_tasks(
    key: jax.Array,
    good: jax.typing.ArrayLike,
    *,
    n: int,
    beta: float = 0.5,
    width: jax.typing.ArrayLike = 0.1,
    margin: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """Samples ``n`` points from each of ``T`` tasks: ``(x, y)``, both ``(T, n)``.

    Args:
      key: PRNG key.
      good: bool ``(T,)``: True for tasks with the target's ``η``, False for decoys (task 0 is
        usually the target and good).
      n: samples per task.
      beta: Bernstein exponent of the target's noise.
      width: decoy flat-zone half-width ``w`` (may be traced).
      margin: decoys have ``η = ½ + margin · sign(x − ½)`` on ``|x − ½| ≤ w``.

    Returns:
      ``x`` float32 in ``[0, 1]`` and ``y`` float32 in ``{0, 1}``.
    """
    good = jnp.asarray(good, bool)
    kx, ky = jax.random.split(key)
    x = jax.random.uniform(kx, (good.shape[0], n))
    eta = target_eta(x, beta=beta)
    flat = 0.5 + margin * jnp.sign(x - 0.5)
    eta = jnp.where(good[:, None] | (jnp.abs(x - 0.5) > width), eta, flat)
    y = (jax.random.uniform(ky, x.shape) < eta).astype(jnp.float32)
    return x, y


def weighted_threshold_erm(
    xs: jax.Array, ys: jax.Array, ws: jax.Array, *, lo: float = 0.0, hi: float = 1.0
) -> jax.Array:
    """ERM over thresholds on a *sorted* weighted sample: the minimiser of
    ``Σ_i w_i (y_i 1[x_i < t] + (1 − y_i) 1[x_i ≥ t])``.

    The error only changes at points of positive weight; the returned threshold is the midpoint
    between the two positive-weight points around the first minimising gap (``lo``/``hi`` at the
    ends), so zero-weight points do not move it.

    Args:
      xs: ``(M,)`` ascending points; ys: ``(M,)`` labels in ``{0, 1}``; ws: ``(M,)`` weights ≥ 0.
      lo, hi: the threshold below all / above all points.

    Returns:
      The scalar threshold.
    """
    m = xs.shape[0]
    pos_w = ws * ys
    neg_w = ws * (1 - ys)
    zero = jnp.zeros((1,), ws.dtype)
    left = jnp.concatenate([zero, jnp.cumsum(pos_w)])  # positives left of gap j (errors)
    right = jnp.sum(neg_w) - jnp.concatenate([zero, jnp.cumsum(neg_w)])  # negatives right of j
    j = jnp.argmin(left + right)  # gap j: between xs[j-1] and xs[j]
    idx = jnp.arange(m)
    active = ws > 0
    prev = jnp.max(jnp.where(active & (idx < j), idx, -1))
    nxt = jnp.min(jnp.where(active & (idx >= j), idx, m))
    a = jnp.where(prev >= 0, xs[jnp.clip(prev, 0, m - 1)], lo)
    b = jnp.where(nxt < m, xs[jnp.clip(nxt, 0, m - 1)], hi)
    return 0.5 * (a + b)


def _per_task_erm(x: jax.Array, y: jax.Array) -> jax.Array:
    order = jnp.argsort(x, axis=1)
    xs = jnp.take_along_axis(x, order, 1)
    ys = jnp.take_along_axis(y, order, 1)
    return jax.vmap(lambda a, b: weighted_threshold_erm(a, b, jnp.ones_like(a)))(xs, ys)


def _val_error(t: jax.Array, x_val: jax.Array, y_val: jax.Array) -> jax.Array:
    pred = (x_val[None, :] >= t[:, None]).astype(jnp.float32)
    return jnp.mean(pred != y_val[None, :], axis=1)


def threshold_estimates(
    x: jax.Array,
    y: jax.Array,
    x_val: jax.Array,
    y_val: jax.Array,
    oracle_mask: jax.Array,
    *,
    beta: float = 0.5,
    agreement_z: float = 2.0,
    lepski_c: float = 1.0,
) -> jax.Array:
    """The thresholds of the estimators in :data:`ESTIMATORS` (in that order): ``(E,)``.

    Args:
      x, y: ``(T, n)`` samples of ``T = N + 1`` tasks, row 0 the target.
      x_val, y_val: ``(n_val,)`` held-out target samples (used only by ``validation_prefix``).
      oracle_mask: bool ``(T,)``: the tasks the oracle pools (target and good sources).
      beta: the rate exponent used by ``lepski`` (``n^{−β/(2−β)}``).
      agreement_z: ``agreement`` keeps sources within ``z`` MADs of the median ERM.
      lepski_c: the constant of ``lepski``'s tolerance.

    Returns:
      float ``(len(ESTIMATORS),)`` thresholds.
    """
    t_tasks, n = x.shape
    task = jnp.repeat(jnp.arange(t_tasks), n)
    order = jnp.argsort(x.reshape(-1))
    xs, ys, ts = x.reshape(-1)[order], y.reshape(-1)[order], task[order]

    def erm(w):  # w: (T,) per-task weights
        return weighted_threshold_erm(xs, ys, w[ts])

    own = _per_task_erm(x, y)  # (T,)
    onehot0 = jnp.zeros((t_tasks,)).at[0].set(1.0)
    ones = jnp.ones((t_tasks,))
    t_target = erm(onehot0)
    t_pool = erm(ones)
    t_oracle = erm(jnp.asarray(oracle_mask, jnp.float32))
    # Agreement clustering: keep tasks near the median of the per-task ERMs.
    med = jnp.median(own)
    mad = jnp.median(jnp.abs(own - med)) + 1e-6
    keep = (jnp.abs(own - med) <= agreement_z * 1.4826 * mad).at[0].set(True)
    t_agree = erm(keep.astype(jnp.float32))
    # Prefixes of tasks ordered by distance to the target's own ERM (target first).
    dist = jnp.abs(own - own[0]).at[0].set(-1.0)
    rank = jnp.argsort(jnp.argsort(dist))  # rank[i]: position of task i
    sizes = 2 ** np.arange(int(np.floor(np.log2(t_tasks))) + 1)
    if sizes[-1] != t_tasks:
        sizes = np.append(sizes, t_tasks)
    sizes = jnp.asarray(sizes)
    t_prefix = jax.vmap(lambda m: erm((rank < m).astype(jnp.float32)))(sizes)
    t_val = t_prefix[jnp.argmin(_val_error(t_prefix, x_val, y_val))]
    # Lepski: the largest prefix within tolerance of every smaller one.
    tol = lepski_c * (n * sizes.astype(jnp.float32)) ** (-beta / (2 - beta))
    ok_pair = jnp.abs(t_prefix[:, None] - t_prefix[None, :]) <= tol[None, :]  # [m, j]: j's tol
    lower = jnp.arange(len(sizes))[None, :] < jnp.arange(len(sizes))[:, None]
    ok = jnp.all(ok_pair | ~lower, axis=1)
    t_lepski = t_prefix[jnp.max(jnp.where(ok, jnp.arange(len(sizes)), 0))]
    # Inverse-variance weighting with a robust spread floor.
    dev2 = (own - t_pool) ** 2
    w_iv = 1.0 / (dev2 + jnp.median(dev2) + 1e-8)
    t_iv = erm(w_iv / jnp.max(w_iv))
    return jnp.stack([t_target, t_pool, t_oracle, t_agree, t_val, t_iv, t_lepski])


def simulate_threshold_family(
    key: jax.Array,
    *,
    num_tasks: int,
    n: int,
    num_good: jax.typing.ArrayLike,
    c: jax.typing.ArrayLike | None = None,
    width: jax.typing.ArrayLike | None = None,
    num_draws: int = 200,
    n_val: int = 20,
    beta: float = 0.5,
    margin: float = 0.0,
    agreement_z: float = 2.0,
    lepski_c: float = 1.0,
    batch_size: int = 8,
) -> jax.Array:
    """Excess target risks of every estimator over ``num_draws`` draws: ``(num_draws, E)``.

    Each draw picks a hidden random set of ``num_good`` good sources among ``num_tasks``
    (the rest are decoys), samples ``n`` points from the target and from each source plus
    ``n_val`` target validation points, and evaluates the closed form
    :func:`threshold_excess_risk` of each estimate. The decoys' flat-zone half-width is either
    rescaled with ``n`` (``c``: :func:`decoy_width` ``(n, c=c)``, one task's ERM resolution, so a
    decoy is equally hard at every ``n``) or fixed (``width``, capped at ½: the same instance at
    every ``n``, the control where n-independence is not built in); give exactly one. Draws are
    ``vmap``-ed in batches of ``batch_size`` (``lax.map``), so ``num_good``, ``c`` and ``width``
    may be traced.

    Raises:
      ValueError: for ``num_tasks < 1``, ``n < 2`` or ``num_draws < 1``, or unless exactly one of
        ``c`` and ``width`` is given.
    """
    if num_tasks < 1 or n < 2 or num_draws < 1 or n_val < 1:
        raise ValueError(
            f"need num_tasks >= 1, n >= 2, num_draws >= 1, n_val >= 1; got {num_tasks}, {n}, "
            f"{num_draws}, {n_val}"
        )
    if (c is None) == (width is None):
        raise ValueError("give exactly one of c (an n-scaled decoy width) and width (a fixed one)")
    _check_beta(beta)
    scaled = width is None
    width = jnp.minimum(c * n ** (-beta / (2 - beta)) if scaled else jnp.asarray(width), 0.5)

    def one(k):
        kp, ks, kv = jax.random.split(k, 3)
        perm = jax.random.permutation(kp, num_tasks)
        good = jnp.concatenate([jnp.ones((1,), bool), perm < num_good])
        x, y = sample_threshold_tasks(ks, good, n=n, beta=beta, width=width, margin=margin)
        xv, yv = sample_threshold_tasks(kv, jnp.ones((1,), bool), n=n_val, beta=beta)
        t = threshold_estimates(
            x, y, xv[0], yv[0], good, beta=beta, agreement_z=agreement_z, lepski_c=lepski_c
        )
        return threshold_excess_risk(t, beta=beta)

    keys = jax.random.split(key, num_draws)
    return jax.lax.map(one, keys, batch_size=min(batch_size, num_draws))


def sample_pool_tasks(
    key: jax.Array,
    scores: jax.Array,
    labels: jax.Array,
    good: jax.typing.ArrayLike,
    *,
    n: int,
    center: float,
    width: jax.typing.ArrayLike,
    starts: jax.typing.ArrayLike | None = None,
    sizes: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Semi-synthetic tasks from a real pool: ``n`` draws (with replacement) per task.

    Good tasks keep the real labels; decoy tasks get fair-coin labels on ``|s − center| ≤ w``
    (the pool's best threshold ``center``), so they share the Bayes threshold but carry no
    boundary information.

    Args:
      key: PRNG key; scores: ``(P,)`` 1-D scores in ``[0, 1]``; labels: ``(P,)`` in ``{0, 1}``.
      good: bool ``(T,)``; n: draws per task; center, width: the decoys' flat zone.
      starts, sizes: optional int ``(T,)``: task ``i`` draws only from the pool segment
        ``[starts[i], starts[i] + sizes[i])`` (real tasks, e.g. the pupils of one school class,
        see :func:`group_pool`); None: every task draws from the whole pool.

    Returns:
      ``x, y``: ``(T, n)`` float32.
    """
    good = jnp.asarray(good, bool)
    ki, ky = jax.random.split(key)
    if (starts is None) != (sizes is None):
        raise ValueError("pass both starts and sizes (per-task pool segments) or neither")
    if starts is None:
        idx = jax.random.randint(ki, (good.shape[0], n), 0, scores.shape[0])
    else:
        u = jax.random.uniform(ki, (good.shape[0], n))
        sizes = jnp.asarray(sizes)
        offset = jnp.minimum(jnp.floor(u * sizes[:, None]).astype(jnp.int32), sizes[:, None] - 1)
        idx = jnp.asarray(starts)[:, None] + offset
    x = jnp.asarray(scores, jnp.float32)[idx]
    y = jnp.asarray(labels, jnp.float32)[idx]
    coin = (jax.random.uniform(ky, x.shape) < 0.5).astype(jnp.float32)
    flat = ~good[:, None] & (jnp.abs(x - center) <= width)
    return x, jnp.where(flat, coin, y)


def empirical_excess_risk(t: jax.typing.ArrayLike, x_test: np.ndarray, y_test: np.ndarray):
    """Test error of ``h_t`` minus the best threshold's test error (real-data excess risk).

    Args:
      t: ``(...)`` thresholds; x_test, y_test: ``(m,)`` scores and binary labels.

    Returns:
      ``(...)`` excess test errors (≥ 0 up to ties).
    """
    order = np.argsort(x_test)
    xs, ys = jnp.asarray(x_test[order]), jnp.asarray(y_test[order], jnp.float32)
    pos = jnp.concatenate([jnp.zeros(1), jnp.cumsum(ys)])
    neg = jnp.sum(1 - ys) - jnp.concatenate([jnp.zeros(1), jnp.cumsum(1 - ys)])
    err = (pos + neg) / xs.shape[0]  # err[j]: threshold between xs[j-1] and xs[j]
    j = jnp.searchsorted(xs, jnp.asarray(t), side="left")
    return err[j] - jnp.min(err)


def rank_scores(values: np.ndarray) -> np.ndarray:
    """Mid-rank empirical CDF of ``values`` in ``(0, 1)`` (ties share their mean rank): a 1-D
    score for the threshold class that keeps only the order of a real covariate."""
    values = np.asarray(values, np.float64)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"values must be a non-empty 1-D array; got shape {values.shape}")
    uniq, inv, counts = np.unique(values, return_inverse=True, return_counts=True)
    below = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return (below + 0.5 * counts)[inv] / len(values)


def group_pool(
    scores: np.ndarray,
    labels: np.ndarray,
    groups: np.ndarray,
    *,
    num_target_groups: int,
    seed: int = 0,
    grid: int = 1001,
) -> dict:
    """Real tasks from a grouped sample (one task per group, e.g. pupils by school class).

    A random ``num_target_groups`` of the groups form the target population; their members are
    split in half into the target's training pool (the target's ``n`` samples and validation
    samples are drawn from it) and its test set. The other groups are the candidate source tasks.

    Args:
      scores: ``(P,)`` 1-D scores in ``[0, 1]``; labels: ``(P,)`` in ``{0, 1}``; groups: ``(P,)``
        integer group ids.
      num_target_groups: groups held out as the target (at least 1, fewer than the groups).
      seed: NumPy seed of the split.
      grid: thresholds tried for the source pool's best threshold ``center``.

    Returns:
      A dict with ``scores``, ``labels`` (float32, the source groups' members sorted by group,
      then the target's training pool), ``group_starts`` / ``group_sizes`` (int32, one per source
      group: its segment of ``scores``), ``target_start`` / ``target_size`` (the target training
      pool's segment), ``test`` (``(scores, labels)`` of the target's test half), ``center`` (best
      threshold on the source pool) and ``pool_error`` (its error there).

    Raises:
      ValueError: for mismatched shapes, labels outside {0, 1} or a bad ``num_target_groups``.
    """
    scores, labels, groups = (np.asarray(a) for a in (scores, labels, groups))
    if not (scores.ndim == labels.ndim == groups.ndim == 1) or not (
        len(scores) == len(labels) == len(groups)
    ):
        raise ValueError("scores, labels and groups must be 1-D arrays of one length")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("labels must be 0 or 1")
    ids = np.unique(groups)
    if not 1 <= num_target_groups < len(ids):
        raise ValueError(
            f"num_target_groups={num_target_groups} is invalid: 1 .. {len(ids) - 1} "
            f"({len(ids)} groups)"
        )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(ids)
    target_ids, source_ids = perm[:num_target_groups], np.sort(perm[num_target_groups:])
    target = np.flatnonzero(np.isin(groups, target_ids))
    target = rng.permutation(target)
    half = len(target) // 2
    t_train, t_test = target[:half], target[half:]
    source = np.flatnonzero(np.isin(groups, source_ids))
    source = source[np.argsort(groups[source], kind="stable")]
    sizes = np.array([np.sum(groups == g) for g in source_ids], np.int32)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
    order = np.concatenate([source, t_train])
    ts = np.linspace(0, 1, grid)
    s_src, y_src = scores[source], labels[source]
    errs = np.array([np.mean((s_src >= t) != y_src) for t in ts])
    return {
        "scores": scores[order].astype(np.float32),
        "labels": labels[order].astype(np.float32),
        "group_starts": starts,
        "group_sizes": sizes,
        "target_start": int(len(source)),
        "target_size": int(len(t_train)),
        "test": (scores[t_test].astype(np.float64), labels[t_test].astype(np.float64)),
        "center": float(ts[int(np.argmin(errs))]),
        "pool_error": float(errs.min()),
    }
