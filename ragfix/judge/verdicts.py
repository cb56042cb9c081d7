"""Verdicts: parsing a judge's reply, unswapping, the order-free verdicts, and the judgment records.

Vocabulary (used throughout ragfix):

* a *slot verdict* is what the judge says in one order: ``"A"`` (first slot better), ``"B"``
  (second slot better), ``"tie"`` or ``"invalid"`` (nothing parseable);
* an *answer verdict* names the answer: ``"A"`` = ``answer_a`` better, ``"B"`` = ``answer_b``
  better. The original order's slot verdict is already an answer verdict; the swapped order's is
  turned into one by :func:`unswap`.

Sources: MT-bench swap aggregation (Zheng et al. 2023, section 3.4, FastChat ``llm_judge``); the
calibrated logit verdict follows the balanced position calibration of Wang et al. 2023 ("Large
Language Models are not Fair Evaluators", section 3.2); the one-order contextual calibration of
the letter probabilities is Zhao et al. 2021 ("Calibrate Before Use", ICML 2021, section 4).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, Field

from ragfix.errors import ConfigError
from ragfix.types import OVERFLOW, JudgePair

#: flag of a judged pair where the judge model gave no reply text in an order (a remote model's
#: ``empty_answer``: ``content: null`` from a reasoning model, a refusal): that order's verdict is
#: ``"invalid"`` and its :attr:`OrderJudgment.empty_reply_reason` holds the server's reason. Not
#: the pair's own ``empty_answer_a`` / ``empty_answer_b``, which are about the answers judged.
EMPTY_JUDGE_REPLY = "empty_judge_reply"

Verdict = Literal["A", "B", "tie", "invalid"]
VERDICTS: tuple[str, ...] = ("A", "B", "tie", "invalid")

_LETTER = {"a": "A", "b": "B", "c": "tie", "tie": "tie"}
#: a quote right before a marker: the reply quotes the format (``"[[A]]" if ...``), not a verdict
_NOT_QUOTED = r"(?<![\"'\u201c\u2018`])"
_MARKER = re.compile(
    _NOT_QUOTED
    + r"\[\[\s*(?:assistant\s+|answer\s+|output\s+)?(a|b|c|tie)(?![a-z])[^\]\n]{0,20}(?:\]\]|$)",
    re.IGNORECASE,
)
# LLMBar's "Output (a)" / "Output (b)" (the whole reply)
_LLMBAR = re.compile(r"^\s*output\s*\((a|b)\)\s*[.!]?\s*$", re.IGNORECASE)
_FREE_FORMS = [
    # "Final verdict: A", "The verdict is a tie.", "Verdict - Assistant B"; a lowercase letter
    # followed by a word is the article ("the verdict is a clear win ...": nothing read)
    re.compile(
        r"\bverdict\s*(?:is|:|-|=)?\s*(?:(?:a\s+)?(tie)\b|(?:assistant|answer|response)\s+(a|b)\b"
        r"|(?-i:([ABC]))(?![\w'])|([abc])(?![\w'])(?!\s+\w))",
        re.IGNORECASE,
    ),
    # "Assistant A is better", "Assistant B's answer is better", "answer A is superior"
    re.compile(
        r"\b(?:assistant|answer|response)\s+(a|b)(?:'s\s+answer)?\s+is\s+"
        r"(?:clearly\s+|slightly\s+|much\s+)?(?:the\s+)?(?:better|superior|preferred)",
        re.IGNORECASE,
    ),
    # the whole reply is one letter or "tie"
    re.compile(r"^\s*(a|b|c|tie)\s*[.!]?\s*$", re.IGNORECASE),
]
#: verdict formats :func:`parse_verdict` reads: the MT-bench ``[[A]]`` markers, LLMBar's
#: ``Output (a)``, or ``any`` (markers, else LLMBar's form, else the free forms)
VERDICT_FORMATS = ("any", "mtbench", "llmbar")


def _found(pattern: re.Pattern, text: str) -> list[Verdict]:
    """The verdicts ``pattern`` reads in ``text``, in order (one capture group per match)."""
    return [_LETTER[m.group(m.lastindex).lower()] for m in pattern.finditer(text)]


def parse_verdict(text: str, fmt: str = "any") -> Verdict:
    """The slot verdict in a judge's reply; ``"invalid"`` when none can be read (never guessed).

    The rule follows the MT-bench judge convention that the verdict is given last ("... then
    output your final verdict"): of the ``[[A]]`` / ``[[B]]`` / ``[[C]]`` markers (also
    ``[[Assistant A]]``, ``[[tie]]``, and an unclosed ``[[A`` at the end of a cut reply), the
    last standalone one wins, so ``[[A]] [[B]]`` is ``B`` and a verdict mentioned while reasoning
    does not hide the final one. A marker right after a quote (``"[[A]]" if assistant A is
    better``) quotes the format and is not a verdict. Letters are read case-insensitively
    (``[[b]]`` is ``B``); ``C`` means tie; single brackets (``[B]``) are not the format.

    Without a marker (format ``any``): LLMBar's ``Output (a)`` / ``Output (b)`` as the whole
    reply; then free forms, the first that matches deciding: ``Verdict: A``, ``The verdict is a
    tie``, ``Assistant B is better``, a bare letter or ``tie`` as the whole reply. Free forms are
    weaker evidence: one naming two different verdicts makes the reply invalid. A tie said in
    words elsewhere ("Both are fine. Tie.") is not read.

    Args:
        text: the judge's reply (for the ``verdict`` style: the prefix ``[[`` plus the reply).
        fmt: ``any`` (default), ``mtbench`` (markers only) or ``llmbar`` (``Output (a)`` /
            ``Output (b)`` only).

    Returns:
        ``"A"``, ``"B"``, ``"tie"`` or ``"invalid"``.

    Raises:
        ConfigError: unknown ``fmt``.
    """
    if fmt not in VERDICT_FORMATS:
        raise ConfigError(f"unknown verdict format {fmt!r}; choose one of: {VERDICT_FORMATS}")
    if fmt in ("any", "mtbench"):
        markers = _found(_MARKER, text)
        if markers or fmt == "mtbench":
            return markers[-1] if markers else "invalid"
    llmbar = _found(_LLMBAR, text)
    if llmbar or fmt == "llmbar":
        return llmbar[-1] if llmbar else "invalid"
    for pattern in _FREE_FORMS:
        found = set(_found(pattern, text))
        if found:
            return found.pop() if len(found) == 1 else "invalid"
    return "invalid"


def unswap(verdict: Verdict) -> Verdict:
    """Map a slot verdict of the swapped order back to the original answers (A <-> B)."""
    return {"A": "B", "B": "A"}.get(verdict, verdict)  # type: ignore[return-value]


def swap_aggregate(original: Verdict, swapped_unswapped: Verdict) -> Verdict:
    """The MT-bench order-free verdict from the two answer verdicts.

    Consistent verdicts stand; inconsistent ones (including a win in one order and a tie in the
    other) become a tie; a pair with an invalid order is invalid (FastChat
    ``show_result.display_result_pairwise`` drops it, Zheng et al. 2023 section 3.4).
    """
    if "invalid" in (original, swapped_unswapped):
        return "invalid"
    return original if original == swapped_unswapped else "tie"


def letter_probs(logprobs: torch.Tensor, token_a: int, token_b: int) -> tuple[float, float]:
    """Probabilities of the verdict letters ``A`` and ``B`` as the next token.

    Args:
        logprobs: float tensor ``[vocab_size]`` of next-token log-probabilities.
        token_a, token_b: token ids of the letters.

    Returns:
        ``(p_A, p_B)``, unnormalised (their sum is the mass the judge puts on the two letters).
    """
    return float(logprobs[token_a].exp()), float(logprobs[token_b].exp())


def logit_verdict(
    probs_original: tuple[float, float],
    probs_swapped: tuple[float, float],
    tie_margin: float = 0.0,
) -> tuple[Verdict, float]:
    """The calibrated logit verdict: an order-free verdict from the letter probabilities.

    In each order the probabilities of the tokens ``A`` and ``B`` are normalised to sum to one;
    the swapped order's are unswapped; the two orders are averaged:

        p(answer_a better) = ( pA_orig / (pA_orig + pB_orig) + pB_swap / (pA_swap + pB_swap) ) / 2

    and p(answer_b better) by the same expression with the letters exchanged. Judging ``(b, a)``
    instead of ``(a, b)`` swaps the two orders, so both sums contain the same two terms: the result
    mirrors exactly (bit for bit), and a first-slot preference adds equally to both answers and
    cancels. Identical answers give an exact tie. The same averaging over both orders is the
    "balanced position calibration" of Wang et al. 2023 ("Large Language Models are not Fair
    Evaluators", section 3.2), applied to token probabilities instead of scores.

    Args:
        probs_original: ``(p_A, p_B)`` in the original order (answer_a in slot A).
        probs_swapped: ``(p_A, p_B)`` in the swapped order (answer_b in slot A).
        tie_margin: a tie when ``|p(a better) - p(b better)| <= tie_margin`` (0: exact ties only).

    Returns:
        ``(verdict, p(answer_a better))``; ``("invalid", 0.5)`` when an order puts no mass on
        either letter.
    """
    (a1, b1), (a2, b2) = probs_original, probs_swapped
    if a1 + b1 <= 0.0 or a2 + b2 <= 0.0:
        return "invalid", 0.5
    p_a = (a1 / (a1 + b1) + b2 / (a2 + b2)) / 2
    p_b = (b1 / (a1 + b1) + a2 / (a2 + b2)) / 2
    if abs(p_a - p_b) <= tie_margin:
        return "tie", p_a
    return ("A" if p_a > p_b else "B"), p_a


def content_free_prior(probs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The judge's letter prior ``p_cf``: the mean over the content-free inputs of the letter
    probabilities ``(p_A, p_B)``, each normalised over the two letters (Zhao et al. 2021,
    section 4; their code averages ``"N/A"``, ``""`` and ``"[MASK]"``).

    Returns:
        ``(p_cf(A), p_cf(B))``, summing to one.

    Raises:
        ConfigError: no inputs, or an input with no mass on either letter (nothing to divide by).
    """
    if not probs or any(a + b <= 0.0 for a, b in probs):
        raise ConfigError(
            "contextual calibration needs the letter probabilities of the content-free "
            "inputs, and this judge put no mass on A or B there"
        )
    ca = sum(a / (a + b) for a, b in probs) / len(probs)
    return ca, 1.0 - ca


def contextual_calibration(
    probs: tuple[float, float], prior: tuple[float, float]
) -> tuple[float, float] | None:
    """Contextual calibration of one order's letter probabilities (Zhao et al. 2021, section 4,
    ``W = diag(p_cf)^-1``, ``b = 0``): ``p`` normalised over the two letters, divided by the
    content-free prior, normalised again:

        q(L) = (p(L) / p_cf(L)) / sum over L' in {A, B} of p(L') / p_cf(L')

    A judge whose letter probabilities on a real pair equal its prior gets ``(0.5, 0.5)``.

    Args:
        probs: ``(p_A, p_B)`` of one order (unnormalised).
        prior: ``(p_cf(A), p_cf(B))`` (:func:`content_free_prior`), both > 0.

    Returns:
        ``(q_A, q_B)`` summing to one, or None when ``probs`` has no mass on either letter.
    """
    (a, b), (ca, cb) = probs, prior
    if a + b <= 0.0:
        return None
    x, y = a / (a + b) / ca, b / (a + b) / cb
    return x / (x + y), y / (x + y)


class OrderJudgment(BaseModel):
    """The judge's output for one order.

    Attributes:
        raw: the reply as generated (for the ``verdict`` style, after the ``[[`` prefix).
        slot_verdict: the parsed verdict about the slots of this order.
        p_a, p_b: next-token probabilities of the letters ``A`` and ``B`` at the verdict
            position (``verdict`` style only, else None).
        samples: slot verdicts of ``repeats`` sampled verdict tokens (``verdict`` style, when
            ``repeats > 1``).
        ll_a, ll_b: in the ``answer`` style, the summed log-probabilities (nats) of the answers
            under the letters ``A`` and ``B`` as the judge's reply (``p_a``, ``p_b`` are then
            their likelihoods normalised over the two); else None.
        q_a, q_b: ``p_a``, ``p_b`` after contextual calibration
            (:func:`contextual_calibration`; judges with ``calibrate="content-free"``, else None).
        empty_reply_reason: when the judge model gave no reply text (its answer flagged
            ``empty_answer``), the server's reason (``"content null, finish_reason stop,
            reasoning_content present"``); else None. The pair is then flagged
            :data:`EMPTY_JUDGE_REPLY`.
    """

    raw: str
    slot_verdict: Verdict
    p_a: float | None = None
    p_b: float | None = None
    samples: list[Verdict] = Field(default_factory=list)
    empty_reply_reason: str | None = None
    q_a: float | None = None
    q_b: float | None = None
    ll_a: float | None = None
    ll_b: float | None = None


def in_slot_terms(order: OrderJudgment) -> OrderJudgment:
    """A judgment of a prompt whose answer "A" is in the second slot (the ``move`` swap, letters
    assigned by content), in slot terms: its verdicts unswapped (``A`` <-> ``B``), its letter
    probabilities (raw and calibrated) and answer log-likelihoods exchanged, so that
    ``slot_verdict`` and ``p_a`` are about the first slot as in every other order."""
    return order.model_copy(
        update={
            "slot_verdict": unswap(order.slot_verdict),
            "p_a": order.p_b,
            "p_b": order.p_a,
            "q_a": order.q_b,
            "q_b": order.q_a,
            "ll_a": order.ll_b,
            "ll_b": order.ll_a,
            "samples": [unswap(v) for v in order.samples],
        }
    )


class PairJudgment(BaseModel):
    """Both orders of one pair and the order-free verdicts (one line of ``judgments.jsonl``).

    Attributes:
        pair_id, label: from the :class:`JudgePair`.
        flags: the :class:`JudgePair`'s flags, plus what the judge found:
            ``overflow`` (:data:`~ragfix.types.OVERFLOW`: an order's prompt plus the answer
            budget does not fit the judge's window, :meth:`~ragfix.backends.Backend.fit`, or
            the server refused it as too long; not judged: both orders empty and
            ``"invalid"``, no logit verdict, and :func:`~ragfix.judge.summarize` leaves the
            pair out of every metric and counts it as ``overflow_pairs``) or
            ``cut_to_window`` (:data:`~ragfix.types.CUT_TO_WINDOW`: the same for a backend that
            cuts long prompts by design; judged on the cut prompt and counted as usual) or
            ``empty_judge_reply`` (:data:`EMPTY_JUDGE_REPLY`: the judge model gave no reply text
            in an order, whose verdict is then ``"invalid"``; the server's reason is that order's
            ``empty_reply_reason``; counted as usual, in the summary's ``flags`` and
            ``empty_reply_reasons``).
        original: the order (answer_a, answer_b).
        swapped: the order (answer_b, answer_a); its ``slot_verdict`` is about the slots.
        verdict_original: answer verdict of the original order alone (the single-order verdict).
        verdict_swapped: answer verdict of the swapped order alone (unswapped).
        consistent: both orders valid and the same answer verdict.
        swap_verdict: :func:`swap_aggregate` of the two.
        logit_verdict, logit_p_a: :func:`logit_verdict` (None for the ``explain`` style).
        seconds: wall seconds the model spent on this pair's two orders (its batch's time
            shared evenly among the batch's pairs); None when the model was not asked (identical
            answers, overflow) or for records written before it was kept.
    """

    pair_id: str
    label: Literal["A", "B", "tie"] | None = None
    flags: list[str] = Field(default_factory=list)
    original: OrderJudgment
    swapped: OrderJudgment
    verdict_original: Verdict
    verdict_swapped: Verdict
    consistent: bool
    swap_verdict: Verdict
    logit_verdict: Verdict | None = None
    logit_p_a: float | None = None
    source: str = ""
    seconds: float | None = None


def combine(
    pair: JudgePair,
    original: OrderJudgment,
    swapped: OrderJudgment,
    tie_margin: float = 0.0,
    flags: Sequence[str] = (),
) -> PairJudgment:
    """Build the :class:`PairJudgment` of a pair from its two :class:`OrderJudgment` (its flags:
    the pair's, then ``flags``)."""
    v1 = original.slot_verdict
    v2 = unswap(swapped.slot_verdict)
    lv, lp = None, None
    if original.p_a is not None and swapped.p_a is not None:
        lv, lp = logit_verdict(
            (original.p_a, original.p_b or 0.0), (swapped.p_a, swapped.p_b or 0.0), tie_margin
        )
    return PairJudgment(
        pair_id=pair.pair_id,
        label=pair.label,
        flags=[*pair.flags, *flags],
        original=original,
        swapped=swapped,
        verdict_original=v1,
        verdict_swapped=v2,
        consistent=v1 == v2 and v1 != "invalid",
        swap_verdict=swap_aggregate(v1, v2),
        logit_verdict=lv,
        logit_p_a=lp,
        source=pair.source,
    )


def overflowed(pair: JudgePair) -> PairJudgment:
    """The record of a pair that was not judged because a prompt does not fit the judge's
    window: flagged ``overflow``, both orders empty and ``"invalid"``, not consistent, no logit
    verdict (see :class:`PairJudgment`)."""
    empty = OrderJudgment(raw="", slot_verdict="invalid")
    return combine(pair, empty, empty.model_copy(), flags=[OVERFLOW])
