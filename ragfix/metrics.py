"""Answer normalisation, best_subspan_em, and position-curve statistics.

``best_subspan_em`` follows Lost in the Middle (Liu et al., TACL 2024,
``src/lost_in_the_middle/metrics.py``): the first line of the prediction and every gold answer are
normalised as in SQuAD (lower case, punctuation removed, the articles a/an/the removed, white space
folded); the prediction is correct when any normalised gold answer is a substring of it. Both are
put in Unicode NFC first (:func:`score_normalize`), so a decomposed ``"Beyonce\u0301"`` matches
the composed ``"Beyoncé"``; on text already in NFC (every gold answer of the shipped Lost in the
Middle files) the scores are Lost in the Middle's.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Sequence

from pydantic import BaseModel

from ragfix.errors import RagfixError

_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation (Lost in the Middle's): lower case, drop punctuation, drop a/an/the,
    fold white space. No Unicode normalisation (scoring adds it: :func:`score_normalize`)."""
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def score_normalize(text: str) -> str:
    """The normalisation scoring applies to a prediction and a gold answer: Unicode NFC
    (composed characters, so ``"e" + U+0301`` is ``"é"``), then :func:`normalize_answer`."""
    return normalize_answer(unicodedata.normalize("NFC", text))


def best_subspan_em(prediction: str, answers: list[str]) -> bool:
    """True when a normalised gold answer is a substring of the normalised first line of
    ``prediction`` (Lost in the Middle's metric, both sides through :func:`score_normalize`;
    character level, so "1" matches "1990"). A gold answer that normalises to nothing is
    ignored."""
    pred = score_normalize(prediction.split("\n")[0].strip())
    golds = (score_normalize(a) for a in answers)
    return any(g in pred for g in golds if g)


def degenerate_gold(answers: Sequence[str]) -> list[str]:
    """Why each degenerate gold answer of ``answers`` makes best_subspan_em loose or void.

    A gold answer is degenerate when its normalised form (:func:`score_normalize`, as scored) is

    * empty (``"*"``, ``"A"``: the article is dropped): Lost in the Middle's metric counts every
      prediction correct (the empty string is a substring of anything); :func:`best_subspan_em`
      ignores such a gold, so it can never be matched. Reason ``gold_normalizes_to_empty:'<gold>'``.
    * one character (``"0"`` is inside ``"10"``). Reason ``gold_len_le_1_char``.
    * stopwords only (``"The Who"`` becomes ``"who"``, inside "not sure who sang it"), by NLTK's
      English list as shipped with ``bm25s`` (``STOPWORDS_EN_PLUS``). Reason
      ``gold_reduces_to_stopword_like:'<normalised>'``.

    The scores stay those of :func:`best_subspan_em` (parity with Lost in the Middle where it is
    well defined); the sweep flags such cells ``degenerate_gold`` and counts them.

    Returns:
        one reason per degenerate gold, in the order of ``answers`` (empty: none).
    """
    from bm25s.stopwords import STOPWORDS_EN_PLUS

    out = []
    for a in answers:
        norm = score_normalize(a)
        if not norm:
            out.append(f"gold_normalizes_to_empty:{a!r}")
        elif len(norm) <= 1:
            out.append("gold_len_le_1_char")
        elif all(w in STOPWORDS_EN_PLUS for w in norm.split()):
            out.append(f"gold_reduces_to_stopword_like:{norm!r}")
    return out


#: flag of a cell with a degenerate gold answer (:func:`degenerate_gold`): scored and counted
DEGENERATE_GOLD = "degenerate_gold"


def cell_flags(answers: list[str], flags: Sequence[str] = ()) -> tuple[list[str], dict]:
    """``flags`` plus ``degenerate_gold`` when a gold answer is degenerate, and the ``extra``
    fields that explain them (``{"degenerate_gold": [reasons]}``)."""
    reasons = degenerate_gold(answers)
    if not reasons:
        return list(flags), {}
    return [*flags, DEGENERATE_GOLD], {DEGENERATE_GOLD: reasons}


def kv_match(prediction: str, value: str) -> bool:
    """KV-retrieval accuracy as Lost in the Middle scores it: the value occurs in the output
    (case-insensitive, whole output, no first-line cut)."""
    return value.lower() in prediction.lower()


#: how a reply that copies the context instead of answering starts: a QA document line
#: (``Document [i](Title: ...)``, :func:`ragfix.tasks.render_document`) or a pipeline chunk line
#: (``Document (Title: ...)``, :data:`ragfix.tasks.CHUNK_TEMPLATE`)
CONTEXT_OPENERS = ("Document [", "Document (Title:")


def continues_context(prediction: str) -> bool:
    """Whether ``prediction`` continues the list of passages instead of answering (it opens like
    a passage of the prompt). A scaled attention that loses the first token's sink shows up this
    way before it shows up in accuracy."""
    return prediction.lstrip().startswith(CONTEXT_OPENERS)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (no continuity correction) for ``successes`` out of ``n``, via
    ``scipy.stats.binomtest(...).proportion_ci(method="wilson")``.

    Returns:
        ``(low, high)`` within ``[0, 1]``; ``(0, 1)`` when ``n == 0``.
    """
    if n == 0:
        return 0.0, 1.0
    from scipy.stats import binomtest  # scipy.stats takes ~1.5 s to import: not at CLI start

    ci = binomtest(successes, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


class PositionStat(BaseModel):
    """Accuracy at one gold position with its 95% Wilson interval."""

    position: int
    n: int
    correct: int
    accuracy: float
    low: float
    high: float


class CurveSummary(BaseModel):
    """A position curve: per-position accuracy and the curve's mean, worst, best and gap.

    ``mean`` is the unweighted mean of the per-position accuracies; ``gap`` = best - worst
    accuracy (in accuracy units, 0..1).
    """

    positions: list[PositionStat]
    mean: float
    worst_position: int
    worst: float
    best_position: int
    best: float
    gap: float


def position_curve(pairs: list[tuple[int, bool]]) -> CurveSummary:
    """Summarise ``(position, correct)`` pairs into a :class:`CurveSummary`.

    Raises:
        RagfixError: ``pairs`` is empty (a run without results).
    """
    if not pairs:
        raise RagfixError("no results to summarise")
    counts: dict[int, list[int]] = {}
    for pos, ok in pairs:
        c = counts.setdefault(pos, [0, 0])
        c[0] += int(ok)
        c[1] += 1
    stats = []
    for pos in sorted(counts):
        k, n = counts[pos]
        lo, hi = wilson_interval(k, n)
        stats.append(PositionStat(position=pos, n=n, correct=k, accuracy=k / n, low=lo, high=hi))
    worst = min(stats, key=lambda s: (s.accuracy, s.position))
    best = max(stats, key=lambda s: (s.accuracy, -s.position))
    return CurveSummary(
        positions=stats,
        mean=sum(s.accuracy for s in stats) / len(stats),
        worst_position=worst.position,
        worst=worst.accuracy,
        best_position=best.position,
        best=best.accuracy,
        gap=best.accuracy - worst.accuracy,
    )


class PairedPosition(BaseModel):
    """One position of a paired comparison: ``n`` cells both runs scored, and how many each got
    right."""

    position: int
    n: int
    baseline_correct: int
    other_correct: int


class PairedComparison(BaseModel):
    """Two curves compared on the cells they share (same sample, same position).

    ``mean_diff`` is the unweighted mean over positions of (other - baseline) accuracy, in
    accuracy units (0..1). ``only_other`` / ``only_baseline`` count the discordant cells, and
    ``p_value`` is the exact two-sided McNemar test on them: the probability of a split at least
    this uneven if both systems were equally good on every cell.
    """

    cells: int
    positions: list[PairedPosition]
    mean_diff: float
    only_other: int
    only_baseline: int
    p_value: float


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for ``b`` and ``c`` discordant pairs: the two-sided
    binomial test (``scipy.stats.binomtest``) of ``b`` successes in ``b + c`` trials at
    p = 1/2 (McNemar 1947; the exact form of Fagerland et al. 2013). 1.0 when there are none."""
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(b, b + c, 0.5).pvalue)


def paired_comparison(
    baseline: dict[tuple[str, int], bool], other: dict[tuple[str, int], bool]
) -> PairedComparison:
    """Compare two runs cell by cell.

    Args:
        baseline, other: ``{(sample_id, position): correct}`` of each run.

    Raises:
        RagfixError: the runs share no cell (they were run on other samples or positions).
    """
    shared = sorted(set(baseline) & set(other), key=lambda k: (k[1], k[0]))
    if not shared:
        raise RagfixError("the two runs share no (sample, position) cell")
    rows: dict[int, PairedPosition] = {}
    for key in shared:
        pos = rows.setdefault(
            key[1], PairedPosition(position=key[1], n=0, baseline_correct=0, other_correct=0)
        )
        pos.n += 1
        pos.baseline_correct += int(baseline[key])
        pos.other_correct += int(other[key])
    positions = [rows[p] for p in sorted(rows)]
    b = sum(1 for k in shared if other[k] and not baseline[k])
    c = sum(1 for k in shared if baseline[k] and not other[k])
    diff = sum((r.other_correct - r.baseline_correct) / r.n for r in positions) / len(positions)
    return PairedComparison(
        cells=len(shared),
        positions=positions,
        mean_diff=diff,
        only_other=b,
        only_baseline=c,
        p_value=mcnemar_exact(b, c),
    )
