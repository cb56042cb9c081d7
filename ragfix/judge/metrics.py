"""Position-bias and agreement metrics of a pairwise judge.

Position consistency, preference fairness and repetition stability follow Shi et al. 2024
("Judging the Judges: A Systematic Investigation of Position Bias in Pairwise Comparative
Assessments by LLMs", arXiv 2406.07791, section 3, code Slimshilin/Position-Bias-Analyzer);
agreement with human labels is accuracy with a Wilson interval and Cohen's kappa.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ragfix.judge.verdicts import Verdict, swap_aggregate, unswap
from ragfix.metrics import mcnemar_exact, wilson_interval
from ragfix.types import OVERFLOW


def _share(k: int, n: int) -> float | None:
    return k / n if n else None


def order_metrics(pairs: Iterable[tuple[Verdict, Verdict]]) -> dict[str, Any]:
    """Position-bias metrics of a judge from its slot verdicts in both orders.

    Args:
        pairs: ``(slot verdict in the original order, slot verdict in the swapped order)``
            per pair. Slot verdicts name slots, not answers: ``("A", "B")`` is consistent (the same
            answer wins both times), ``("A", "A")`` means slot A won both times.

    Returns:
        a dict with

        * ``pairs``; ``valid_pairs`` (both orders parsed); ``invalid_rate``: share of the
          ``2 * pairs`` single verdicts that are invalid; ``tie_rate``: share of the valid single
          verdicts that are ties;
        * ``position_consistency`` (PC, Shi et al. 2024 section 3.2): ``consistent / valid_pairs``
          where a pair is consistent when its slot pair is ``AB``, ``BA`` or ``CC``, with its 95%
          Wilson interval ``pc_low`` / ``pc_high``;
        * ``primacy_pairs``: inconsistent pairs that favour the first slot (``AA``, ``AC``,
          ``CA``); ``recency_pairs``: those that favour the second (``BB``, ``BC``, ``CB``);
        * ``preference_fairness`` (PF, Shi et al. 2024 section 3.2, ``calculate_positional_
          consistency_and_preference_score``): with ``pc`` primacy and ``rc`` recency pairs,
          ``pp = pc / (pc + rc)`` and ``rp = rc / (pc + rc)``, ``PF_raw = rc * rp - pc * pp``,
          min-max rescaled from ``[-n, n]`` to ``[-1, 1]``, i.e. ``PF = PF_raw / n`` with
          ``n = valid_pairs``. ``-1``: every pair inconsistent towards the first slot; ``+1``:
          towards the second; ``0``: fair (no inconsistency, or balanced). The reference code
          takes ``n`` over all pairs of a unit including extraction failures; here ``n`` counts
          the pairs both of whose verdicts were read, so the ends of the scale stay reachable;
        * ``first_slot_win_rate``: share of the decisive (A or B) single verdicts that pick the
          first slot. Each pair is shown once in each order, so a judge without position bias
          scores 0.5 whatever the answers' quality.

        Rates are None when their denominator is 0.
    """
    n = valid = consistent = primacy = recency = invalid = ties = first = decisive = 0
    for v1, v2 in pairs:
        n += 1
        for v in (v1, v2):
            invalid += v == "invalid"
            if v != "invalid":
                ties += v == "tie"
            if v in ("A", "B"):
                decisive += 1
                first += v == "A"
        if "invalid" in (v1, v2):
            continue
        valid += 1
        key = {"A": "A", "B": "B", "tie": "C"}[v1] + {"A": "A", "B": "B", "tie": "C"}[v2]
        if key in ("AB", "BA", "CC"):
            consistent += 1
        elif key in ("AA", "AC", "CA"):
            primacy += 1
        else:
            recency += 1
    biased = primacy + recency
    pf_raw = (recency * recency / biased - primacy * primacy / biased) if biased else 0.0
    lo, hi = wilson_interval(consistent, valid)
    return {
        "pairs": n,
        "valid_pairs": valid,
        "invalid_rate": _share(invalid, 2 * n),
        "tie_rate": _share(ties, 2 * n - invalid),
        "position_consistency": _share(consistent, valid),
        "pc_low": lo if valid else None,
        "pc_high": hi if valid else None,
        "consistent_pairs": consistent,
        "primacy_pairs": primacy,
        "recency_pairs": recency,
        "preference_fairness": pf_raw / valid if valid else None,
        "first_slot_win_rate": _share(first, decisive),
    }


def cohen_kappa(y1: Sequence[str], y2: Sequence[str]) -> float | None:
    """Cohen's kappa between two label sequences (Cohen 1960): ``(p_o - p_e) / (1 - p_e)`` with
    ``p_o`` the observed agreement and ``p_e`` the agreement expected from the two marginals.

    Returns:
        kappa, or None when ``p_e == 1`` (both raters use one and the same category) or the input
        is empty.
    """
    n = len(y1)
    if n == 0:
        return None
    po = sum(a == b for a, b in zip(y1, y2, strict=True)) / n
    c1, c2 = Counter(y1), Counter(y2)
    pe = sum(c1[k] * c2[k] for k in c1) / (n * n)
    return None if pe == 1 else (po - pe) / (1 - pe)


def agreement(verdicts: Sequence[Verdict], labels: Sequence[str | None]) -> dict[str, Any] | None:
    """Agreement of answer verdicts with human labels over the labelled pairs.

    An invalid verdict counts as a disagreement (it stays in the denominator and is its own
    category for kappa); a tie agrees only with a tie label.

    Returns:
        ``{"n", "accuracy", "acc_low", "acc_high", "kappa", "ties", "invalid"}`` (accuracy with its
        95% Wilson interval; Cohen's kappa, see :func:`cohen_kappa`), or None when no pair has a
        label (agreement is then not reported).
    """
    got = [(v, lab) for v, lab in zip(verdicts, labels, strict=True) if lab is not None]
    if not got:
        return None
    vs, ls = [v for v, _ in got], [lab for _, lab in got]
    right = sum(v == lab for v, lab in got)
    lo, hi = wilson_interval(right, len(got))
    return {
        "n": len(got),
        "accuracy": right / len(got),
        "acc_low": lo,
        "acc_high": hi,
        "kappa": cohen_kappa(vs, ls),
        "ties": sum(v == "tie" for v in vs),
        "invalid": sum(v == "invalid" for v in vs),
    }


def repetition_stability(samples: Iterable[Sequence[Verdict]]) -> float | None:
    """Repetition stability (RS, Shi et al. 2024 section 3.1): per prompt, the share of the most
    frequent of its ``t`` sampled verdicts (``max_count / t``), averaged over prompts. 1 = the
    judge says the same thing every time; ``1/3`` is the floor for three options.

    Returns:
        RS, or None without samples.
    """
    vals = [Counter(s).most_common(1)[0][1] / len(s) for s in samples if len(s)]
    return sum(vals) / len(vals) if vals else None


#: the verdict kinds reported for agreement: name -> (record field, description)
VERDICT_KINDS = {
    "single_original": ("verdict_original", "one order, as given (A first)"),
    "single_swapped": ("verdict_swapped", "one order, swapped (B first)"),
    "swap_aggregated": ("swap_verdict", "both orders, inconsistent -> tie (MT-bench)"),
    "logit_original": ("logit_original", "argmax p(A) vs p(B), original order only"),
    "logit_calibrated": ("logit_verdict", "p(A), p(B) of both orders averaged (order-free)"),
    "contextual_original": (
        "contextual_original",
        "argmax of p / p_cf, original order only (one pass, Zhao et al. 2021)",
    ),
}


def _logit_slot(o: dict, field: str = "p") -> Verdict:
    """The per-order argmax verdict of the letter probabilities (``field="p"``) or of the
    calibrated ones (``"q"``), in slot terms; ``"invalid"`` without them."""
    a, b = o.get(f"{field}_a"), o.get(f"{field}_b")
    if a is None or b is None or a + b <= 0:
        return "invalid"
    return "A" if a > b else "B" if b > a else "tie"


def verdict_correct(records: Iterable[dict], field: str = "verdict_original") -> dict[str, bool]:
    """``{pair_id: the verdict equals the label}`` over the labelled pairs judged (overflowing
    pairs left out). ``field`` is a verdict field of the records (``verdict_original``: the
    generated one-pass verdict, ``swap_verdict``, ``logit_verdict``, ...), ``logit_original``
    (the argmax of the original order's letter probabilities) or ``contextual_original`` (of its
    contextually calibrated ones)."""
    out = {}
    for r in records:
        if r.get("label") is None or OVERFLOW in r.get("flags", ()):
            continue
        out[r["pair_id"]] = record_verdict(r, field) == r["label"]
    return out


def record_verdict(record: dict, field: str = "verdict_original") -> Verdict | None:
    """One verdict of a judged pair's record: a verdict ``field`` (``verdict_original``,
    ``swap_verdict``, ``logit_verdict``, ...), or ``logit_original`` / ``contextual_original``
    (the argmax of the original order's letter probabilities, raw or contextually calibrated);
    ``None`` for a field the record lacks."""
    scores = {"logit_original": "p", "contextual_original": "q"}.get(field)
    return _logit_slot(record["original"], scores) if scores else record.get(field)


def paired_agreement(baseline: dict[str, bool], other: dict[str, bool]) -> dict | None:
    """Two verdicts' agreement with the labels on the pairs both judged (``{pair_id: correct}``
    each), with the exact McNemar test (:func:`ragfix.metrics.mcnemar_exact`).

    Returns:
        ``{"pairs", "baseline_correct", "other_correct", "only_other", "only_baseline",
        "p_value"}``, or None when they share no pair.
    """
    shared = sorted(set(baseline) & set(other))
    if not shared:
        return None
    b = sum(other[k] and not baseline[k] for k in shared)
    c = sum(baseline[k] and not other[k] for k in shared)
    return {
        "pairs": len(shared),
        "baseline_correct": sum(baseline[k] for k in shared),
        "other_correct": sum(other[k] for k in shared),
        "only_other": b,
        "only_baseline": c,
        "p_value": mcnemar_exact(b, c),
    }


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Every judge metric of a list of :class:`PairJudgment` records (as dicts).

    A pair flagged ``overflow`` (its prompt did not fit the judge's window: not judged) is left
    out of every metric (position bias, agreement, repetition stability, letter mass) and
    counted in ``overflow_pairs`` (and in ``flags``). An order the judge model gave no reply
    text for (``empty_judge_reply``) counts as an invalid verdict, as any unreadable reply.

    Returns:
        ``{"pairs": all records, "overflow_pairs", "labelled": records with a label, "flags":
        {flag: records}, "empty_reply_reasons": {the server's reason: orders without reply
        text}, "generated": order_metrics, "logit": order_metrics of the per-order
        argmax of p(A) vs p(B) or None, "contextual": the same of the contextually calibrated
        q(A) vs q(B) or None (a judge without calibration), "agreement": {kind: agreement or
        None},
        "repetition_stability", "letter_mass", "seconds_per_pair"}``, the metrics over the
        judged pairs (their ``pairs`` / ``n`` count those). ``letter_mass`` is the mean
        next-token probability on ``A`` plus ``B`` (how much the judge is answering in the
        format at all); ``seconds_per_pair`` the mean model wall time of a pair's two orders
        over the pairs that record it (None when none does).
    """
    every = records
    records = [r for r in every if OVERFLOW not in r.get("flags", [])]
    gen = order_metrics(
        (r["original"]["slot_verdict"], r["swapped"]["slot_verdict"]) for r in records
    )
    has_logit = bool(records) and all(r["original"].get("p_a") is not None for r in records)
    logit = (
        order_metrics((_logit_slot(r["original"]), _logit_slot(r["swapped"])) for r in records)
        if has_logit
        else None
    )
    has_cal = bool(records) and all(r["original"].get("q_a") is not None for r in records)
    contextual = (
        order_metrics(
            (_logit_slot(r["original"], "q"), _logit_slot(r["swapped"], "q")) for r in records
        )
        if has_cal
        else None
    )
    labels = [r.get("label") for r in records]
    agree: dict[str, Any] = {}
    for kind, (field, _) in VERDICT_KINDS.items():
        if field == "logit_original":
            vs = [_logit_slot(r["original"]) for r in records] if has_logit else None
        elif field == "contextual_original":
            vs = [_logit_slot(r["original"], "q") for r in records] if has_cal else None
        else:
            vs = [r.get(field) for r in records]
            vs = None if any(v is None for v in vs) else vs
        agree[kind] = agreement(vs, labels) if vs is not None else None
    flags = Counter(f for r in every for f in r.get("flags", []))
    empty = Counter(
        o["empty_reply_reason"]
        for r in every
        for o in (r["original"], r["swapped"])
        if o.get("empty_reply_reason") is not None
    )
    samples = [o["samples"] for r in records for o in (r["original"], r["swapped"])]
    mass = (
        [o["p_a"] + o["p_b"] for r in records for o in (r["original"], r["swapped"])]
        if has_logit
        else []
    )
    secs = [r["seconds"] for r in records if r.get("seconds") is not None]
    return {
        "pairs": len(every),
        "overflow_pairs": len(every) - len(records),
        "labelled": sum(r.get("label") is not None for r in every),
        "flags": dict(flags),
        "empty_reply_reasons": dict(empty),
        "generated": gen,
        "logit": logit,
        "contextual": contextual,
        "agreement": agree,
        "repetition_stability": repetition_stability(s for s in samples if s),
        "letter_mass": sum(mass) / len(mass) if mass else None,
        "seconds_per_pair": sum(secs) / len(secs) if secs else None,
    }


def summarize_swap_judgments(rows: Sequence[dict]) -> dict[str, Any]:
    """The same metrics for verdicts another judge already produced in both orders.

    Args:
        rows: ``{"original", "swapped", "label"}`` with *slot* verdicts per order (as
            :func:`ragfix.connectors.pairwise.load_swap_judgments` returns them).

    Returns:
        as :func:`summarize`, without the logit parts.
    """
    records = []
    for r in rows:
        v1, v2 = r["original"], unswap(r["swapped"])
        records.append(
            {
                "label": r.get("label"),
                "flags": [],
                "original": {"slot_verdict": r["original"], "samples": [], "p_a": None},
                "swapped": {"slot_verdict": r["swapped"], "samples": [], "p_a": None},
                "verdict_original": v1,
                "verdict_swapped": v2,
                "swap_verdict": swap_aggregate(v1, v2),
                "logit_verdict": None,
            }
        )
    return summarize(records)
