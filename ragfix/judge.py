"""Pairwise LLM-as-judge with position swap, order-free verdicts, and position-bias metrics.

Every pair (question, answer A, answer B) is judged twice: in the original order (A in the first
slot) and in the swapped order (B in the first slot). A judge that reads its first slot more
kindly than its second gives different answers in the two orders; the metrics below measure how
often and in which direction, and the order-free verdicts remove the order's influence.

Vocabulary (used throughout ragfix):

* a *slot verdict* is what the judge says in one order: ``"A"`` (first slot better), ``"B"``
  (second slot better), ``"tie"`` or ``"invalid"`` (nothing parseable);
* an *answer verdict* names the answer: ``"A"`` = ``answer_a`` better, ``"B"`` = ``answer_b``
  better. The original order's slot verdict is already an answer verdict; the swapped order's is
  turned into one by :func:`unswap`.

Sources: MT-bench pairwise judging and swap aggregation (Zheng et al., NeurIPS 2023 Datasets and
Benchmarks, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena", section 3.4 and FastChat
``llm_judge``); position consistency, preference fairness and repetition stability (Shi et al.
2024, "Judging the Judges: A Systematic Investigation of Position Bias in Pairwise Comparative
Assessments by LLMs", arXiv 2406.07791, section 3, code Slimshilin/Position-Bias-Analyzer).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field

from ragfix.backends.base import Backend
from ragfix.metrics import wilson_interval

Verdict = Literal["A", "B", "tie", "invalid"]
VERDICTS: tuple[str, ...] = ("A", "B", "tie", "invalid")

# ---------------------------------------------------------------------------------- prompts

_INSTRUCTIONS = (
    "You are a fair judge. Two AI assistants answered the user question below. Decide which "
    "answer follows the user's instructions and answers the question better: consider whether "
    "it is correct, helpful, relevant and precise. The order in which the answers are shown "
    "must not influence you, and neither must their length or the assistants' names."
)
_REFERENCE_NOTE = (
    " A reference answer is given: compare both answers with it and treat any departure from "
    "it as a mistake."
)
_EXPLAIN = (
    " First compare the two answers in a short explanation. Then give your final verdict in "
    'exactly this format: "[[A]]" if assistant A is better, "[[B]]" if assistant B is better, '
    'or "[[C]]" for a tie.'
)
_VERDICT_ONLY = (
    ' Reply with your verdict only, in exactly this format: "[[A]]" if assistant A is better, '
    '"[[B]]" if assistant B is better, or "[[C]]" for a tie.'
)

#: prompt styles: ``explain`` = MT-bench pair-v2 style (explanation, then the verdict; for judges
#: that follow instructions), ``verdict`` = the verdict only, with the assistant turn prefilled
#: with ``[[`` so the next token is the verdict letter (small models; gives the logit verdict).
STYLES = ("verdict", "explain")


def judge_prompt(
    question: str, first: str, second: str, reference: str | None = None, style: str = "verdict"
) -> str:
    """The user turn of an MT-bench style pairwise judge prompt, ``first`` in slot A.

    Laid out as FastChat's ``pair-v2`` / ``pair-math-v1`` templates (Zheng et al. 2023): the
    question, an optional reference answer, then the two answers in marked blocks; the verdict
    format is ``[[A]]`` / ``[[B]]`` / ``[[C]]``.

    Raises:
        ValueError: unknown ``style``.
    """
    if style not in STYLES:
        raise ValueError(
            f"unknown judge prompt style {style!r}; choose one of: {', '.join(STYLES)}"
        )
    head = _INSTRUCTIONS + (_REFERENCE_NOTE if reference else "")
    head += _EXPLAIN if style == "explain" else _VERDICT_ONLY
    parts = [head, f"[User Question]\n{question}"]
    if reference:
        parts.append(f"[The Start of Reference Answer]\n{reference}\n[The End of Reference Answer]")
    parts.append(f"[The Start of Assistant A's Answer]\n{first}\n[The End of Assistant A's Answer]")
    parts.append(
        f"[The Start of Assistant B's Answer]\n{second}\n[The End of Assistant B's Answer]"
    )
    return "\n\n".join(parts)


#: the assistant-turn prefix of the ``verdict`` style (the verdict letter comes next)
VERDICT_PREFIX = "[["

# ---------------------------------------------------------------------------------- parsing

_LETTER = {"a": "A", "b": "B", "c": "tie", "tie": "tie"}
_BRACKETED = re.compile(
    r"\[\[\s*(?:assistant\s+|answer\s+|output\s+)?(a|b|c|tie)(?![a-z])[^\]\n]{0,20}(?:\]\]|$)",
    re.IGNORECASE,
)
_FREE_FORMS = [
    # "Final verdict: A", "verdict is [B]", "Verdict - Assistant B"
    re.compile(
        r"verdict\s*(?:is|:|-)?\s*\[*\s*(?:assistant\s+)?(a|b|c|tie)(?![a-z0-9])", re.IGNORECASE
    ),
    # "Assistant A is better", "Assistant B's answer is better", "answer A is superior"
    re.compile(
        r"\b(?:assistant|answer|response)\s+(a|b)(?:'s\s+answer)?\s+is\s+"
        r"(?:clearly\s+|slightly\s+|much\s+)?(?:the\s+)?(?:better|superior|preferred)",
        re.IGNORECASE,
    ),
    # LLMBar's "Output (a)" / "Output (b)"
    re.compile(r"^\s*output\s*\((a|b)\)\s*$", re.IGNORECASE),
    # the whole reply is one letter or "tie"
    re.compile(r"^\s*\[*\s*(a|b|c|tie)\s*\]*\s*[.!]?\s*$", re.IGNORECASE),
]


def parse_verdict(text: str) -> Verdict:
    """The slot verdict in a judge's reply; ``"invalid"`` when none can be read (never guessed).

    Recognised, in this order: the MT-bench markers ``[[A]]`` / ``[[B]]`` / ``[[C]]`` (also
    ``[[Assistant A]]``, ``[[tie]]``, and an unclosed ``[[A`` at the end of a cut reply); then
    free forms: ``Verdict: A``, ``Assistant B is better``, LLMBar's ``Output (a)``, a bare
    letter. ``C`` means tie. If the first form that matches names two different verdicts (e.g.
    the reply repeats the instructions ``"[[A]]" if ... "[[B]]" if ...``), the reply is invalid.

    Args:
        text: the judge's reply (for the ``verdict`` style: the prefix ``[[`` plus the reply).

    Returns:
        ``"A"``, ``"B"``, ``"tie"`` or ``"invalid"``.
    """
    for pattern in (_BRACKETED, *_FREE_FORMS):
        found = {_LETTER[m.lower()] for m in pattern.findall(text)}
        if len(found) == 1:
            return found.pop()  # type: ignore[return-value]
        if len(found) > 1:
            return "invalid"
    return "invalid"


def unswap(verdict: Verdict) -> Verdict:
    """Map a slot verdict of the swapped order back to the original answers (A <-> B)."""
    return {"A": "B", "B": "A"}.get(verdict, verdict)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- verdicts


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


# ---------------------------------------------------------------------------------- records


class JudgePair(BaseModel):
    """One pair to judge.

    Attributes:
        pair_id: a deterministic id (the key of ``judgments.jsonl``).
        question: the user question (instruction plus input).
        answer_a, answer_b: the two answers; ``answer_a`` goes first in the original order.
        reference: an optional reference answer (MT-bench math/reasoning/coding).
        label: the human verdict as an answer verdict (``"A"``, ``"B"``, ``"tie"``), or None.
        source: where the pair came from (``file:line``).
    """

    pair_id: str
    question: str
    answer_a: str
    answer_b: str
    reference: str | None = None
    label: Literal["A", "B", "tie"] | None = None
    source: str = ""

    @property
    def flags(self) -> list[str]:
        """Input problems: ``empty_answer_a``, ``empty_answer_b``, ``identical_answers``."""
        out = []
        if not self.answer_a.strip():
            out.append("empty_answer_a")
        if not self.answer_b.strip():
            out.append("empty_answer_b")
        if self.answer_a.strip() == self.answer_b.strip():
            out.append("identical_answers")
        return out


def pair_id(*parts: str) -> str:
    """A short deterministic id from the texts of a pair (sha1, 16 hex digits)."""
    return hashlib.sha1("\x1f".join(parts).encode()).hexdigest()[:16]


class OrderJudgment(BaseModel):
    """The judge's output for one order.

    Attributes:
        raw: the reply as generated (for the ``verdict`` style, after the ``[[`` prefix).
        slot_verdict: the parsed verdict about the slots of this order.
        p_a, p_b: next-token probabilities of the letters ``A`` and ``B`` at the verdict
            position (``verdict`` style only, else None).
        samples: slot verdicts of ``repeats`` sampled verdict tokens (``verdict`` style, when
            ``repeats > 1``).
    """

    raw: str
    slot_verdict: Verdict
    p_a: float | None = None
    p_b: float | None = None
    samples: list[Verdict] = Field(default_factory=list)


class PairJudgment(BaseModel):
    """Both orders of one pair and the order-free verdicts (one line of ``judgments.jsonl``).

    Attributes:
        pair_id, label, flags: from the :class:`JudgePair`.
        original: the order (answer_a, answer_b).
        swapped: the order (answer_b, answer_a); its ``slot_verdict`` is about the slots.
        verdict_original: answer verdict of the original order alone (the single-order verdict).
        verdict_swapped: answer verdict of the swapped order alone (unswapped).
        consistent: both orders valid and the same answer verdict.
        swap_verdict: :func:`swap_aggregate` of the two.
        logit_verdict, logit_p_a: :func:`logit_verdict` (None for the ``explain`` style).
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


def combine(
    pair: JudgePair, original: OrderJudgment, swapped: OrderJudgment, tie_margin: float = 0.0
) -> PairJudgment:
    """Build the :class:`PairJudgment` of a pair from its two :class:`OrderJudgment`."""
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
        flags=pair.flags,
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


# ---------------------------------------------------------------------------------- the judge


def _letter_token(backend: Backend, prefix: str, letter: str) -> int:
    """The single token the tokenizer uses for ``letter`` right after ``prefix``.

    Raises:
        ValueError: the letter is not one token after the prefix.
    """
    base = backend.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    full = backend.tokenizer(prefix + letter, add_special_tokens=False)["input_ids"]
    if full[: len(base)] != base or len(full) != len(base) + 1:
        raise ValueError(
            f"the logit verdict needs {letter!r} to be one token after {prefix!r} "
            f"for this tokenizer; use --style explain"
        )
    return full[-1]


@torch.no_grad()
def next_token_logprobs_batch(backend: Backend, batch: list[list[int]]) -> torch.Tensor:
    """Next-token log-probabilities after each token-id prompt of a batch.

    Backends that override :meth:`Backend.next_token_logprobs` (their own decoding path, e.g.
    GALI) are called one prompt at a time; the others in one left-padded forward pass with
    position IDs counted from each prompt's first real token.

    Args:
        batch: ``B`` prompts as token-id lists.

    Returns:
        float32 tensor ``[B, vocab_size]`` on the CPU.
    """
    if type(backend).next_token_logprobs is not Backend.next_token_logprobs:
        tok = backend.tokenizer
        return torch.stack([backend.next_token_logprobs(tok.decode(ids)) for ids in batch])
    width = max(len(x) for x in batch)
    pad = backend.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=backend.device)
    mask = torch.tensor(
        [[0] * (width - len(x)) + [1] * len(x) for x in batch], device=backend.device
    )
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = backend.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
    return torch.log_softmax(out.logits[:, -1].float(), dim=-1).cpu()


class PairwiseJudge:
    """A ragfix backend used as a pairwise judge, every pair in both orders.

    Args:
        backend: any ragfix :class:`Backend` (vanilla, channel-scaled, ...).
        style: ``"verdict"`` (default: verdict only, assistant turn prefilled with ``[[``; gives
            the logit verdict) or ``"explain"`` (MT-bench: explanation then verdict).
        max_new_tokens: generation budget per order (default 4 for ``verdict``, 256 for
            ``explain``).
        repeats: with ``repeats > 1`` (``verdict`` style), that many verdict tokens are sampled
            per order from the judge's next-token distribution (temperature 1, seeded) to
            measure repetition stability.
        seed: seed of that sampling.
        tie_margin: see :func:`logit_verdict`.
        batch_size: prompts per forward pass.

    Raises:
        ValueError: unknown style, ``repeats > 1`` with the ``explain`` style, or a tokenizer
            whose ``A`` / ``B`` are not single tokens after ``[[``.
    """

    def __init__(
        self,
        backend: Backend,
        style: str = "verdict",
        max_new_tokens: int | None = None,
        repeats: int = 1,
        seed: int = 0,
        tie_margin: float = 0.0,
        batch_size: int = 8,
    ):
        if style not in STYLES:
            raise ValueError(f"unknown judge style {style!r}; choose one of: {', '.join(STYLES)}")
        if repeats < 1:
            raise ValueError("repeats must be >= 1")
        if repeats > 1 and style != "verdict":
            raise ValueError("--repeats > 1 samples the verdict token: it needs --style verdict")
        self.backend = backend
        self.style = style
        self.max_new_tokens = max_new_tokens or (4 if style == "verdict" else 256)
        self.repeats = repeats
        self.tie_margin = tie_margin
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.prefix = VERDICT_PREFIX if style == "verdict" else ""
        if style == "verdict":
            self.token_a = _letter_token(backend, self.prefix, "A")
            self.token_b = _letter_token(backend, self.prefix, "B")

    def settings(self) -> dict:
        """What makes two judge runs comparable: backend identity plus the judge settings."""
        return {
            **self.backend.identity(),
            "style": self.style,
            "max_new_tokens": self.max_new_tokens,
            "repeats": self.repeats,
            "tie_margin": self.tie_margin,
        }

    def prompt_ids(self, question: str, first: str, second: str, reference: str | None) -> list:
        """Token ids of the chat-formatted judge prompt with ``first`` in slot A."""
        user = judge_prompt(question, first, second, reference, self.style)
        return self.backend.encode(self.backend.chat_prompt(user, self.prefix))

    def _generate(self, batch: list[list[int]]) -> tuple[list[str], torch.Tensor | None]:
        """Greedy replies to a batch of prompts and (``verdict`` style) the log-probabilities of
        their first new token, ``[B, vocab_size]``. Backends on the shared generation path get
        both from one ``generate`` call; the others (own decoding loop) from two calls."""
        b = self.backend
        own_path = type(b).generate_ids is not Backend.generate_ids
        if self.style != "verdict" or own_path:
            texts = [g.text for g in b.generate_ids(batch, self.max_new_tokens, False)]
            lps = next_token_logprobs_batch(b, batch) if self.style == "verdict" else None
            return texts, lps
        width = max(len(x) for x in batch)
        pad = b.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=b.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=b.device)
        kwargs = b._generation_kwargs(self.max_new_tokens, False)
        kwargs["generation_config"].return_dict_in_generate = True
        kwargs["generation_config"].output_logits = True
        with torch.no_grad():
            out = b.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        texts = [b._decode(row, False)[0] for row in out.sequences[:, width:].tolist()]
        return texts, torch.log_softmax(out.logits[0].float(), dim=-1).cpu()

    def _judge_orders(self, batch: list[list[int]]) -> list[OrderJudgment]:
        texts, lps = self._generate(batch)
        out = []
        for i, text in enumerate(texts):
            o = OrderJudgment(raw=text, slot_verdict=parse_verdict(self.prefix + text))
            if lps is not None:
                o.p_a, o.p_b = letter_probs(lps[i], self.token_a, self.token_b)
                if self.repeats > 1:
                    draws = torch.multinomial(
                        lps[i].exp(), self.repeats, replacement=True, generator=self.generator
                    )
                    tok = self.backend.tokenizer
                    o.samples = [parse_verdict(self.prefix + tok.decode([t])) for t in draws]
            out.append(o)
        return out

    def judge_pairs(
        self,
        pairs: Sequence[JudgePair],
        on_result: Callable[[PairJudgment], None] | None = None,
    ) -> list[PairJudgment]:
        """Judge ``pairs`` in both orders, ``batch_size`` prompts per pass (pairs sorted by prompt
        length to limit padding; both orders of a pair share a batch).

        Pairs with identical answers are not sent to the model: both orders are a tie (flagged
        ``identical_answers``).

        Args:
            pairs: the pairs.
            on_result: called with each :class:`PairJudgment` as soon as it is done (the CLI
                appends it to ``judgments.jsonl``).

        Returns:
            one :class:`PairJudgment` per pair, in order.
        """
        results: dict[int, PairJudgment] = {}
        prompts: dict[int, tuple[list[int], list[int]]] = {}
        for i, p in enumerate(pairs):
            if "identical_answers" in p.flags:
                same = 0.5 if self.style == "verdict" else None
                tie = OrderJudgment(raw="", slot_verdict="tie", p_a=same, p_b=same)
                results[i] = combine(p, tie, tie, self.tie_margin)
                if on_result is not None:
                    on_result(results[i])
            else:
                prompts[i] = (
                    self.prompt_ids(p.question, p.answer_a, p.answer_b, p.reference),
                    self.prompt_ids(p.question, p.answer_b, p.answer_a, p.reference),
                )
        order = sorted(prompts, key=lambda i: len(prompts[i][0]))  # limits padding
        per_step = max(1, self.batch_size // 2)
        for start in range(0, len(order), per_step):
            chunk = order[start : start + per_step]
            orders = iter(self._judge_orders([ids for i in chunk for ids in prompts[i]]))
            for i in chunk:
                results[i] = combine(pairs[i], next(orders), next(orders), self.tie_margin)
                if on_result is not None:
                    on_result(results[i])
        return [results[i] for i in range(len(pairs))]

    def judge(
        self, question: str, answer_a: str, answer_b: str, reference: str | None = None
    ) -> PairJudgment:
        """Judge one pair in both orders.

        Returns:
            a :class:`PairJudgment`: both orders' raw replies and verdicts, the single-order
            verdicts, whether they are consistent, the swap-aggregated verdict and (``verdict``
            style) the calibrated logit verdict.
        """
        pair = JudgePair(
            pair_id=pair_id(question, answer_a, answer_b, reference or ""),
            question=question,
            answer_a=answer_a,
            answer_b=answer_b,
            reference=reference,
        )
        return self.judge_pairs([pair])[0]


# ---------------------------------------------------------------------------------- metrics


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
}


def _logit_slot(o: dict) -> Verdict:
    if o.get("p_a") is None or (o["p_a"] + o["p_b"]) <= 0:
        return "invalid"
    return "A" if o["p_a"] > o["p_b"] else "B" if o["p_b"] > o["p_a"] else "tie"


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Every judge metric of a list of :class:`PairJudgment` records (as dicts).

    Returns:
        ``{"pairs", "flags", "generated": order_metrics, "logit": order_metrics of the per-order
        argmax of p(A) vs p(B) or None, "agreement": {kind: agreement or None}, "labelled",
        "repetition_stability", "letter_mass"}``. ``letter_mass`` is the mean next-token
        probability on ``A`` plus ``B`` (how much the judge is answering in the format at all).
    """
    gen = order_metrics(
        (r["original"]["slot_verdict"], r["swapped"]["slot_verdict"]) for r in records
    )
    has_logit = bool(records) and all(r["original"].get("p_a") is not None for r in records)
    logit = (
        order_metrics((_logit_slot(r["original"]), _logit_slot(r["swapped"])) for r in records)
        if has_logit
        else None
    )
    labels = [r.get("label") for r in records]
    agree: dict[str, Any] = {}
    for kind, (field, _) in VERDICT_KINDS.items():
        if field == "logit_original":
            vs = [_logit_slot(r["original"]) for r in records] if has_logit else None
        else:
            vs = [r.get(field) for r in records]
            vs = None if any(v is None for v in vs) else vs
        agree[kind] = agreement(vs, labels) if vs is not None else None
    flags = Counter(f for r in records for f in r.get("flags", []))
    samples = [o["samples"] for r in records for o in (r["original"], r["swapped"])]
    mass = (
        [o["p_a"] + o["p_b"] for r in records for o in (r["original"], r["swapped"])]
        if has_logit
        else []
    )
    return {
        "pairs": len(records),
        "labelled": sum(lab is not None for lab in labels),
        "flags": dict(flags),
        "generated": gen,
        "logit": logit,
        "agreement": agree,
        "repetition_stability": repetition_stability(s for s in samples if s),
        "letter_mass": sum(mass) / len(mass) if mass else None,
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


# ---------------------------------------------------------------------------------- report


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "—"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def print_judge_summary(summaries: dict[str, dict], console=None) -> None:
    """Two tables for one or more judges (one row per judge, or per judge and verdict kind):
    position bias (position consistency with its 95% interval, preference fairness, first-slot
    win rate, tie and invalid rates) and agreement with the human labels (accuracy, Cohen's
    kappa) for each verdict kind."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="position bias (each pair judged in both orders)", title_justify="left")
    for col in ("judge", "verdicts", "pairs", "consistency [95% CI]", "pref. fairness",
                "first-slot wins", "ties", "invalid"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("judge", "verdicts") else "right")
    for name, s in summaries.items():
        for kind in ("generated", "logit"):
            m = s.get(kind)
            if m is None:
                continue
            ci = (
                f"{_fmt(m['position_consistency'])} [{_fmt(m['pc_low'])}, {_fmt(m['pc_high'])}]"
                if m["position_consistency"] is not None
                else "—"
            )
            t.add_row(
                name,
                "generated" if kind == "generated" else "logit argmax",
                str(m["pairs"]),
                ci,
                _fmt(m["preference_fairness"], signed=True),
                _fmt(m["first_slot_win_rate"]),
                _fmt(m["tie_rate"]),
                _fmt(m["invalid_rate"]),
            )
    console.print(t)
    if not any(s["labelled"] for s in summaries.values()):
        console.print("no human labels in the data: agreement not reported")
        return
    a = Table(title="agreement with human labels", title_justify="left")
    for col in ("judge", "verdict", "n", "accuracy [95% CI]", "kappa", "ties", "invalid"):
        a.add_column(col, justify="left" if col in ("judge", "verdict") else "right")
    for name, s in summaries.items():
        for kind in VERDICT_KINDS:
            g = s["agreement"].get(kind)
            if g is None:
                continue
            a.add_row(
                name,
                kind,
                str(g["n"]),
                f"{g['accuracy']:.3f} [{g['acc_low']:.3f}, {g['acc_high']:.3f}]",
                _fmt(g["kappa"], signed=True),
                str(g["ties"]),
                str(g["invalid"]),
            )
    console.print(a)
    for kind, (_, desc) in VERDICT_KINDS.items():
        console.print(f"  {kind}: {desc}", highlight=False)


def plot_judges(summaries: dict[str, dict], path, title: str | None = None) -> None:
    """A PNG to read at a glance, one row per judge (written atomically).

    Left: what happened to each pair across the two orders, as shares of all pairs: consistent,
    inconsistent towards the first slot, towards the second slot, an order unreadable. Right:
    accuracy against the human labels of the single-order, swap-aggregated and calibrated logit
    verdicts (dashed line: always picking one side on balanced labels).
    """
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ragfix.io import atomic_write_bytes

    rows = []
    for name, s in summaries.items():
        for kind in ("generated", "logit"):
            if s.get(kind) is not None:
                rows.append((name if kind == "generated" else f"{name} (logit argmax)", s[kind]))
    names = [r[0] for r in rows]
    fig, (ax, ax2) = plt.subplots(
        1, 2, figsize=(12, 2.2 + 0.55 * len(rows)), dpi=110, gridspec_kw={"width_ratios": [3, 2]}
    )
    left = [0.0] * len(rows)
    parts = [
        ("consistent", "consistent_pairs", "#2a9d8f"),
        ("favours first slot", "primacy_pairs", "#e76f51"),
        ("favours second slot", "recency_pairs", "#f4a261"),
    ]
    for label, key, color in parts:
        vals = [m[key] / m["pairs"] if m["pairs"] else 0.0 for _, m in rows]
        ax.barh(names, vals, left=left, color=color, label=label)
        for i, v in enumerate(vals):
            if v >= 0.06:
                ax.text(left[i] + v / 2, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    rest = [1.0 - x for x in left]
    ax.barh(names, rest, left=left, color="#bbbbbb", label="an order unreadable")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("share of pairs (each judged in both orders)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4)
    ax.set_title("position consistency", fontsize=10)
    kinds = [("single_original", "single order"), ("swap_aggregated", "swap-aggregated"),
             ("logit_calibrated", "calibrated logit")]  # fmt: skip
    judge_names = list(summaries)
    width = 0.8 / len(kinds)
    for k, (kind, label) in enumerate(kinds):
        ys, xs = [], []
        for i, name in enumerate(judge_names):
            g = summaries[name]["agreement"].get(kind)
            if g is not None:
                ys.append(i + (k - 1) * width)
                xs.append(g["accuracy"])
        if xs:
            ax2.barh(ys, xs, height=width, label=label)
    ax2.set_yticks(range(len(judge_names)), judge_names)
    ax2.axvline(0.5, color="k", ls="--", lw=0.8)
    ax2.set_xlim(0, 1)
    ax2.invert_yaxis()
    ax2.set_xlabel("accuracy vs human labels")
    ax2.set_title("agreement with humans", fontsize=10)
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


# ---------------------------------------------------------------------------------- LlamaIndex


def _evaluator_class() -> type:
    """Build the LlamaIndex evaluator class (llama-index-core is imported only when asked for)."""
    from llama_index.core.evaluation import BaseEvaluator, EvaluationResult
    from llama_index.core.evaluation.pairwise import EvaluationSource

    class RagfixPairwiseEvaluator(BaseEvaluator):
        """A LlamaIndex evaluator with the interface of ``PairwiseComparisonEvaluator``
        (``llama_index.core.evaluation``, 0.14): ``evaluate(query, response, second_response=...,
        reference=...)`` -> ``EvaluationResult`` with ``score`` 1.0 (``response`` better), 0.0
        (``second_response`` better) or 0.5 (tie), ``passing`` True / False / None.

        The pair is always judged in both orders by a :class:`PairwiseJudge`; the result carries an
        order-free verdict instead of LlamaIndex's vote rule:

        * ``verdict="logit"`` (default with the ``verdict`` style): the calibrated logit verdict;
        * ``verdict="swap"``: the MT-bench swap-aggregated verdict (inconsistent -> tie).

        ``pairwise_source`` is ``"original"`` when both orders agree and ``"neither"`` when they do
        not; ``feedback`` holds both orders' raw replies and verdicts; an unparseable verdict gives
        ``invalid_result=True``.

        Raises:
            ValueError: ``verdict="logit"`` with a judge of the ``explain`` style; ``evaluate``
                without ``query``, ``response`` or ``second_response``.
        """

        def __init__(self, judge: PairwiseJudge, verdict: Literal["logit", "swap"] = "logit"):
            if verdict == "logit" and judge.style != "verdict":
                raise ValueError("the logit verdict needs a judge with style='verdict'")
            self.judge = judge
            self.verdict = verdict

        def _get_prompts(self) -> dict:
            return {}

        def _update_prompts(self, prompts: dict) -> None:
            """The judge prompt is fixed (its wording is part of what is measured)."""

        async def aevaluate(  # type: ignore[override]
            self,
            query: str | None = None,
            response: str | None = None,
            contexts: Sequence[str] | None = None,
            second_response: str | None = None,
            reference: str | None = None,
            sleep_time_in_seconds: int = 0,
            **kwargs: Any,
        ) -> EvaluationResult:
            """Judge ``response`` against ``second_response`` for ``query`` in both orders."""
            if query is None or response is None or second_response is None:
                raise ValueError("query, response and second_response must be provided")
            res = self.judge.judge(query, response, second_response, reference)
            v = res.logit_verdict if self.verdict == "logit" else res.swap_verdict
            feedback = (
                f"original order: {res.original.raw!r} -> {res.verdict_original}; "
                f"swapped order: {res.swapped.raw!r} -> {res.verdict_swapped}; "
                f"{self.verdict} verdict: {v}"
            )
            if v == "invalid":
                return EvaluationResult(
                    query=query,
                    response=response,
                    feedback=feedback,
                    invalid_result=True,
                    invalid_reason="no verdict could be read from the judge's replies",
                )
            return EvaluationResult(
                query=query,
                response=response,
                contexts=contexts,
                passing={"A": True, "B": False}.get(v),
                score={"A": 1.0, "B": 0.0, "tie": 0.5}[v],
                feedback=feedback,
                pairwise_source=(
                    EvaluationSource.ORIGINAL if res.consistent else EvaluationSource.NEITHER
                ),
            )

    return RagfixPairwiseEvaluator


def __getattr__(name: str):
    """``RagfixPairwiseEvaluator`` is created on first access, so importing :mod:`ragfix.judge`
    does not import LlamaIndex."""
    if name == "RagfixPairwiseEvaluator":
        cls = _evaluator_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
