"""Figures of merit of a position curve, and of two runs compared on the same cells.

Every comparison reports the mean over positions, the worst position and the best-worst gap,
each with a 95% interval, and the exact McNemar p-value per position.

Intervals:

* **One position** (and so the worst position): the Wilson score interval of its accuracy
  (:func:`ragfix.metrics.wilson_interval`, via :func:`ragfix.metrics.position_curve`).
* **Mean over positions and best-worst gap**: a percentile bootstrap over samples. The sample
  ids are resampled with replacement (``n_resamples=2000`` draws from a ``numpy`` generator seeded
  with ``seed``, so the numbers are reproducible); a sample keeps all its positions, so the
  correlation between the positions of one question is kept. Every position's accuracy is
  recomputed from the resampled samples' cells, then the mean (or gap); the interval is the 2.5th
  and 97.5th percentile of the resampled values (Efron & Tibshirani, *An Introduction to the
  Bootstrap*, 1993, ch. 13). With fewer than two samples there is no interval (``None``).
  The gap is a max minus a min, so its bootstrap distribution leans upwards: with few samples its
  interval may not contain the observed gap.
* **Two runs** (:func:`paired_merit`): the same resampled sample ids are applied to both runs, which
  gives the paired intervals of the difference of means and of gaps. Per position, the exact
  McNemar test on the discordant cells (:func:`ragfix.metrics.mcnemar_exact`); overall,
  :func:`ragfix.metrics.paired_comparison`.

All accuracies and differences are in accuracy units (0..1).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from ragfix.metrics import PositionStat, mcnemar_exact, paired_comparison, position_curve

#: significance level of the tests ("not significant" when p >= ALPHA)
ALPHA = 0.05
#: bootstrap settings used unless told otherwise
N_RESAMPLES = 2000
SEED = 0

Cells = dict[tuple[str, int], bool]


class Interval(BaseModel):
    """A 95% interval ``[low, high]`` (accuracy units)."""

    low: float
    high: float


class Bootstrap(BaseModel):
    """How the bootstrap intervals were made (written next to them in every JSON)."""

    method: str = "percentile"
    unit: str = "sample"
    resamples: int = N_RESAMPLES
    seed: int = SEED
    confidence: float = 0.95


class CurveMerit(BaseModel):
    """A run's curve and its figures of merit.

    ``positions`` carry each position's accuracy and Wilson interval; ``mean`` is the unweighted
    mean over positions, ``gap`` = best - worst; ``worst_ci`` is the Wilson interval at the worst
    position, ``mean_ci`` and ``gap_ci`` are bootstrap intervals over samples (``None`` with
    fewer than two samples).
    """

    samples: int
    cells: int
    positions: list[PositionStat]
    mean: float
    mean_ci: Interval | None
    worst_position: int
    worst: float
    worst_ci: Interval
    best_position: int
    best: float
    gap: float
    gap_ci: Interval | None
    bootstrap: Bootstrap


class PositionDiff(BaseModel):
    """One position of a paired comparison: ``n`` shared cells, each run's accuracy on them,
    ``diff`` = other - baseline, the discordant cells and the exact McNemar p-value."""

    position: int
    n: int
    baseline: float
    other: float
    diff: float
    only_other: int
    only_baseline: int
    p_value: float
    significant: bool


class PairedMerit(BaseModel):
    """Two runs on the cells they share (same sample, same position).

    ``mean_diff`` and ``gap_diff`` are other - baseline (a negative ``gap_diff`` is a flatter
    curve), with paired bootstrap intervals; ``p_value`` is the exact McNemar test over all shared
    cells (``only_other`` / ``only_baseline`` discordant cells).
    """

    samples: int
    cells: int
    positions: list[PositionDiff]
    mean_diff: float
    mean_diff_ci: Interval | None
    gap_diff: float
    gap_diff_ci: Interval | None
    only_other: int
    only_baseline: int
    p_value: float
    significant: bool
    bootstrap: Bootstrap


def significance(p_value: float) -> str:
    """``"significant"`` when ``p_value < ALPHA`` (0.05), else ``"not significant"``."""
    return "significant" if p_value < ALPHA else "not significant"


def _matrix(cells: Cells, samples: list[str], positions: list[int]) -> tuple[np.ndarray, ...]:
    """``(correct, present)``, both float ``[len(samples), len(positions)]``."""
    s_index = {s: i for i, s in enumerate(samples)}
    p_index = {p: j for j, p in enumerate(positions)}
    correct = np.zeros((len(samples), len(positions)))
    present = np.zeros_like(correct)
    for (sid, pos), ok in cells.items():
        if sid in s_index and pos in p_index:
            correct[s_index[sid], p_index[pos]] = float(ok)
            present[s_index[sid], p_index[pos]] = 1.0
    return correct, present


def _resample(n: int, boot: Bootstrap) -> np.ndarray:
    """``[resamples, n]`` counts: how often each of ``n`` samples is drawn in each resample."""
    rng = np.random.default_rng(boot.seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=boot.resamples).astype(float)


def _accuracy(weights: np.ndarray, correct: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Per-position accuracy of every resample, ``[resamples, positions]`` (NaN where a resample
    holds no cell of a position)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (weights @ correct) / (weights @ present)


def _mean(acc: np.ndarray) -> np.ndarray:
    return np.nanmean(acc, axis=-1)


def _gap(acc: np.ndarray) -> np.ndarray:
    return np.nanmax(acc, axis=-1) - np.nanmin(acc, axis=-1)


def _interval(values: np.ndarray, boot: Bootstrap) -> Interval:
    tail = 100 * (1 - boot.confidence) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return Interval(low=float(low), high=float(high))


def curve_merit(cells: Cells, *, resamples: int = N_RESAMPLES, seed: int = SEED) -> CurveMerit:
    """Figures of merit of one curve.

    Args:
        cells: ``{(sample_id, position): correct}``.
        resamples, seed: the bootstrap's draws and seed.

    Raises:
        RagfixError: ``cells`` is empty.
    """
    boot = Bootstrap(resamples=resamples, seed=seed)
    curve = position_curve([(pos, ok) for (_, pos), ok in cells.items()])
    samples = sorted({sid for sid, _ in cells})
    positions = [s.position for s in curve.positions]
    mean_ci = gap_ci = None
    if len(samples) > 1:
        acc = _accuracy(_resample(len(samples), boot), *_matrix(cells, samples, positions))
        mean_ci, gap_ci = _interval(_mean(acc), boot), _interval(_gap(acc), boot)
    worst = next(s for s in curve.positions if s.position == curve.worst_position)
    return CurveMerit(
        samples=len(samples),
        cells=len(cells),
        positions=curve.positions,
        mean=curve.mean,
        mean_ci=mean_ci,
        worst_position=curve.worst_position,
        worst=curve.worst,
        worst_ci=Interval(low=worst.low, high=worst.high),
        best_position=curve.best_position,
        best=curve.best,
        gap=curve.gap,
        gap_ci=gap_ci,
        bootstrap=boot,
    )


def paired_merit(
    baseline: Cells, other: Cells, *, resamples: int = N_RESAMPLES, seed: int = SEED
) -> PairedMerit:
    """Compare two runs on the cells both have.

    Args:
        baseline, other: ``{(sample_id, position): correct}`` of each run.
        resamples, seed: the bootstrap's draws and seed.

    Raises:
        RagfixError: the runs share no cell.
    """
    boot = Bootstrap(resamples=resamples, seed=seed)
    overall = paired_comparison(baseline, other)
    shared = set(baseline) & set(other)
    rows = []
    for p in overall.positions:
        keys = [k for k in shared if k[1] == p.position]
        b = sum(1 for k in keys if other[k] and not baseline[k])
        c = sum(1 for k in keys if baseline[k] and not other[k])
        pv = mcnemar_exact(b, c)
        rows.append(
            PositionDiff(
                position=p.position,
                n=p.n,
                baseline=p.baseline_correct / p.n,
                other=p.other_correct / p.n,
                diff=(p.other_correct - p.baseline_correct) / p.n,
                only_other=b,
                only_baseline=c,
                p_value=pv,
                significant=pv < ALPHA,
            )
        )
    base_acc = np.array([r.baseline for r in rows])
    other_acc = np.array([r.other for r in rows])
    gap_diff = float(_gap(other_acc) - _gap(base_acc))
    samples = sorted({sid for sid, _ in shared})
    positions = [r.position for r in rows]
    mean_ci = gap_ci = None
    if len(samples) > 1:
        weights = _resample(len(samples), boot)
        b_acc = _accuracy(weights, *_matrix({k: baseline[k] for k in shared}, samples, positions))
        o_acc = _accuracy(weights, *_matrix({k: other[k] for k in shared}, samples, positions))
        mean_ci = _interval(_mean(o_acc - b_acc), boot)
        gap_ci = _interval(_gap(o_acc) - _gap(b_acc), boot)
    return PairedMerit(
        samples=len(samples),
        cells=overall.cells,
        positions=rows,
        mean_diff=overall.mean_diff,
        mean_diff_ci=mean_ci,
        gap_diff=gap_diff,
        gap_diff_ci=gap_ci,
        only_other=overall.only_other,
        only_baseline=overall.only_baseline,
        p_value=overall.p_value,
        significant=overall.p_value < ALPHA,
        bootstrap=boot,
    )


class RetrievalWeighted(BaseModel):
    """A rank curve weighted by where the real retriever put the gold chunk (pipeline sweeps).

    ``accuracy`` = sum over ranks r of ``n_r * acc(r)`` / sum of ``n_r``, where ``n_r`` is the
    number of questions whose gold chunk the retriever ranked r (0-based) and ``acc(r)`` the
    curve's accuracy at swept rank r: what a user of this retriever sees on average, among the
    ``retrieved`` of ``questions`` questions whose gold chunk it returned (the others are left
    out); ``ranks`` = ``{r: n_r}`` over the swept ranks. ``ci``: percentile bootstrap over
    questions, each resample recomputing both the rank counts and the curve (``None`` with
    fewer than two questions).
    """

    accuracy: float
    ci: Interval | None
    retrieved: int
    questions: int
    ranks: dict[int, int]
    bootstrap: Bootstrap


def retrieval_weighted_merit(
    cells: Cells,
    natural_rank: dict[str, int | None],
    *,
    resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> RetrievalWeighted | None:
    """The retrieval-weighted accuracy of one rank curve, with its interval.

    Args:
        cells: ``{(sample_id, swept rank): correct}``.
        natural_rank: ``{sample_id: the gold chunk's rank in the retriever's own order}``,
            ``None`` for a question whose gold chunk the retriever missed.
        resamples, seed: the bootstrap's draws (0: no interval) and seed.

    Returns:
        ``None`` when no question of ``cells`` has its natural rank among the swept ranks.
    """
    boot = Bootstrap(resamples=resamples, seed=seed)
    samples = sorted({sid for sid, _ in cells})
    positions = sorted({pos for _, pos in cells})
    p_index = {p: j for j, p in enumerate(positions)}
    at = np.zeros((len(samples), len(positions)))
    for i, sid in enumerate(samples):
        rank = natural_rank.get(sid)
        if rank in p_index:
            at[i, p_index[rank]] = 1.0
    if not at.any():
        return None
    correct, present = _matrix(cells, samples, positions)

    def weighted(weights: np.ndarray) -> np.ndarray:
        acc = _accuracy(weights, correct, present)
        counts = weights @ at
        counts = np.where(np.isnan(acc), 0.0, counts)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.nansum(counts * acc, axis=-1) / counts.sum(axis=-1)

    value = float(weighted(np.ones((1, len(samples))))[0])
    ci = None
    if len(samples) > 1 and resamples > 0:
        values = weighted(_resample(len(samples), boot))
        ci = _interval(values[~np.isnan(values)], boot)
    return RetrievalWeighted(
        accuracy=value,
        ci=ci,
        retrieved=int(at.sum()),
        questions=len(samples),
        ranks={p: int(n) for p, n in zip(positions, at.sum(axis=0), strict=True) if n},
        bootstrap=boot,
    )
