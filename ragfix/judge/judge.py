"""The pairwise judge: any :class:`~ragfix.backends.base.Backend` judges every pair in both orders.

The judge talks to the model only through the model interface: one batched
``generate(..., first_logprobs=True)`` call gives each order's reply and, from exactly the input
that reply was generated from, the log-probabilities of the verdict letter (so a backend that cuts
or rewrites its input, e.g. ``truncated``, scores the letters on the same input it answers from).
MT-bench pairwise judging with position swap: Zheng et al. 2023, section 3.4. The letter prior
(a judge that prefers a letter, whichever answer carries it) is removed by letters assigned by
content (:func:`~ragfix.judge.prompts.content_labels`) and/or contextual calibration (Zhao et
al., "Calibrate Before Use", ICML 2021, section 4).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from ragfix.backends.base import Backend, Fit
from ragfix.errors import ConfigError, Interrupted
from ragfix.judge.prompts import (
    ANSWER_PREFIX,
    ANSWER_SEPARATOR,
    STYLES,
    VERDICT_PREFIX,
    answer_spans,
    content_labels,
    judge_prompt,
)
from ragfix.judge.verdicts import (
    EMPTY_JUDGE_REPLY,
    OrderJudgment,
    PairJudgment,
    combine,
    content_free_prior,
    contextual_calibration,
    in_slot_terms,
    letter_probs,
    overflowed,
    parse_verdict,
)
from ragfix.prompts import TaskPrompt
from ragfix.types import (
    CUT_TO_WINDOW,
    EMPTY_ANSWER,
    INVALID_TEXT,
    OVERFLOW,
    REASONING_UNFINISHED,
    SERVED_MODEL_MISMATCH,
    Generation,
    JudgePair,
    pair_id,
)

#: how the second order of a pair is made (see :class:`PairwiseJudge`)
SWAPS = ("relabel", "move")
#: how the assistant letters are given (see :class:`PairwiseJudge`)
LABELS = ("slot", "content")
#: how the letter probabilities are calibrated (see :class:`PairwiseJudge`)
CALIBRATIONS = ("none", "content-free")
#: the content-free inputs of contextual calibration (Zhao et al. 2021, section 4 and their
#: code's ensemble): each replaces the question, both answers and the reference
CONTENT_FREE_INPUTS = ("N/A", "", "[MASK]")
#: the letters of the first and second slot in the MT-bench layout
SLOT_LABELS = ("A", "B")
#: the assistant-turn prefix of each prompt style
PREFIXES = {"verdict": VERDICT_PREFIX, "explain": "", "answer": ANSWER_PREFIX}


def check_judge_settings(
    style: str,
    repeats: int,
    swap: str = "relabel",
    labels: str = "slot",
    calibrate: str = "none",
) -> None:
    """Refuse judge settings that cannot work, before any model is loaded.

    Raises:
        ConfigError: unknown ``style``, ``swap``, ``labels`` or ``calibrate``, ``repeats < 1``,
            ``repeats > 1`` with a style other than ``verdict`` (repeats sample the verdict
            token), or calibration with a style other than ``verdict`` (it calibrates the
            verdict letter's probabilities).
    """
    if swap not in SWAPS:
        raise ConfigError(f"unknown swap {swap!r}; choose one of: {', '.join(SWAPS)}")
    if labels not in LABELS:
        raise ConfigError(f"unknown labels {labels!r}; choose one of: {', '.join(LABELS)}")
    if calibrate not in CALIBRATIONS:
        raise ConfigError(
            f"unknown calibration {calibrate!r}; choose one of: {', '.join(CALIBRATIONS)}"
        )
    if calibrate != "none" and style != "verdict":
        raise ConfigError("calibration calibrates the verdict letter: it needs style 'verdict'")
    if style not in STYLES:
        raise ConfigError(f"unknown judge style {style!r}; choose one of: {', '.join(STYLES)}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if repeats > 1 and style != "verdict":
        raise ConfigError("repeats > 1 samples the verdict token: it needs style 'verdict'")


def pair_layouts(
    pair: JudgePair, swap: str = "relabel", labels: str = "slot"
) -> tuple[tuple[str, str], tuple[str, str]]:
    """The assistant letters of the first and second slot in both orders of ``pair``: with
    ``labels="slot"`` the original order reads ``("A", "B")`` and the swapped one ``("A", "B")``
    (``relabel``: the answers exchange letters) or ``("B", "A")`` (``move``: the letters travel
    with the answers); with ``labels="content"`` each answer keeps the letter its text gives it
    (:func:`~ragfix.judge.prompts.content_labels`) in both orders, whatever ``swap``."""
    if labels == "content":
        la, lb = content_labels(pair.answer_a, pair.answer_b)
        return (la, lb), (lb, la)
    return SLOT_LABELS, (("B", "A") if swap == "move" else SLOT_LABELS)


def pair_prompts(
    pair: JudgePair,
    style: str = "verdict",
    swap: str = "relabel",
    max_new_tokens: int = 4,
    labels: str = "slot",
) -> tuple[TaskPrompt, TaskPrompt]:
    """The prompts of both orders of ``pair`` (:class:`PairwiseJudge`'s, which a judge run's
    report rebuilds from the pair file): the original order (``answer_a`` in the first slot),
    then the swapped one (``answer_b`` first), with the letters of :func:`pair_layouts`. Each
    has its answer blocks as passages, the assistant turn prefilled with ``[[`` in the
    ``verdict`` style, and ``max_new_tokens``."""
    q, ref = pair.question, pair.reference
    one, two = pair_layouts(pair, swap, labels)
    return (
        order_prompt(q, pair.answer_a, pair.answer_b, ref, style, max_new_tokens, one),
        order_prompt(q, pair.answer_b, pair.answer_a, ref, style, max_new_tokens, two),
    )


def order_prompt(
    question: str,
    first: str,
    second: str,
    reference: str | None,
    style: str = "verdict",
    max_new_tokens: int = 4,
    labels: tuple[str, str] = SLOT_LABELS,
) -> TaskPrompt:
    """The judge prompt of one order, ``first`` in the first slot with letter ``labels[0]``:
    the :func:`judge_prompt` user turn with its answer blocks as passages, the assistant turn
    prefilled with ``[[`` in the ``verdict`` style and :data:`~ragfix.judge.prompts.ANSWER_PREFIX`
    in the ``answer`` style (the backend applies its chat template)."""
    user = judge_prompt(question, first, second, reference, style, labels)
    return TaskPrompt(
        user=user,
        assistant_prefix=PREFIXES[style],
        max_new_tokens=max_new_tokens,
        stop_at_newline=False,
        passages=answer_spans(user, labels),
        passage_separator=ANSWER_SEPARATOR,
    )


def letter_token(backend: Backend, prefix: str, letter: str) -> int:
    """The single token the backend's tokenizer uses for ``letter`` right after ``prefix``.

    Raises:
        ConfigError: the letter is not one token after the prefix (the logit verdict then cannot
            be read; use style ``explain``).
    """
    base = backend.tokenize(prefix)
    full = backend.tokenize(prefix + letter)
    if full[: len(base)] != base or len(full) != len(base) + 1:
        raise ConfigError(
            f"the logit verdict needs {letter!r} to be one token after {prefix!r} "
            "for this tokenizer; use style 'explain' (--style explain)"
        )
    return full[-1]


def _refused(fit: Fit, gen: Generation) -> bool:
    """Whether an order that ran does not count: the server refused its prompt as too long
    (``overflow`` in the generation's flags) or, when the prompt could not be counted
    beforehand, the prompt tokens the server counted plus the budget exceed the window."""
    late = fit.prompt_tokens is None and not fit.counted(gen.prompt_tokens).runs
    return late or OVERFLOW in gen.flags


#: the backend flags of a reply with no text to read a verdict from
_NO_REPLY = (EMPTY_ANSWER, REASONING_UNFINISHED)


class PairwiseJudge:
    """A ragfix backend used as a pairwise judge, every pair in both orders.

    Args:
        backend: any :class:`~ragfix.backends.base.Backend` (vanilla, channel-scaled, gali,
            truncated, any adapter, a remote model).
        style: ``"verdict"`` (default: verdict only, assistant turn prefilled with ``[[``; gives
            the logit verdict), ``"explain"`` (MT-bench: explanation then verdict) or
            ``"answer"``: no letter is asked for; the judge is asked to copy the better answer
            and each answer is scored as that reply (:meth:`Backend.loglikelihood
            <ragfix.backends.base.Backend.loglikelihood>` of ``" " + answer`` after the
            :data:`~ragfix.judge.prompts.ANSWER_PREFIX`), the more likely one winning: the cloze
            formulation of multiple choice, which small models answer where they cannot bind
            an answer to its symbol (Robinson and Wingate, ICLR 2023, "Leveraging Large
            Language Models for Multiple Choice Question Answering", section 2; Gu et al.
            2024, OLMES, section 3.2). Each order's ``p_a`` / ``p_b`` are the two answers'
            likelihoods normalised over the pair (``ll_a`` / ``ll_b`` the summed
            log-probabilities), so the logit verdict averages the two orders' normalised
            likelihoods; nothing is generated (``raw`` is empty). The sums are not normalised
            by length, so the shorter answer is favoured: meant for answers of about the same
            length (a KV value against another).
        max_new_tokens: generation budget per order (default 4 for ``verdict``, 256 for
            ``explain``).
        repeats: with ``repeats > 1`` (``verdict`` style), that many verdict tokens are sampled
            per order from the judge's first-step distribution (temperature 1, seeded) to
            measure repetition stability (Shi et al. 2024, section 3.1).
        seed: seed of that sampling.
        tie_margin: see :func:`ragfix.judge.verdicts.logit_verdict`.
        batch_size: prompts decoded together; both orders of a pair are given in one call
            (their shared prefix prefilled once), and at 1 each is decoded alone.
        swap: how the second order is made: ``relabel`` (MT-bench: the answers exchange
            places and labels, answer_b is then "Assistant A") or ``move`` (the two answer
            blocks exchange places with their labels, answer_a stays "Assistant A" but is read
            second). Every :class:`OrderJudgment` is stored in slot terms (its verdict and
            letter probabilities about the first and second slot), so every metric reads it the
            same way.
        labels: ``slot`` (MT-bench: the first slot is "Assistant A") or ``content`` (each
            answer's letter follows from its text, :func:`~ragfix.judge.prompts.content_labels`:
            it keeps its letter in both orders, so a prior for a letter is no longer a prior
            for a slot, and a reader of the answers as a set (``pine``) reads the same prompt
            in both orders under either swap).
        calibrate: ``none`` or ``content-free``: contextual calibration of each order's letter
            probabilities (Zhao et al. 2021, section 4): the letter prior ``p_cf`` is measured
            once per letter layout (and with or without a reference) on prompts whose question,
            answers and reference are all one content-free input (:data:`CONTENT_FREE_INPUTS`,
            averaged) and divided out (:func:`~ragfix.judge.verdicts.contextual_calibration`,
            stored as ``q_a`` / ``q_b``); the priors are :attr:`priors`, the model passes they
            took :attr:`prior_passes`.

    With a backend that has no tokenizer here (a remote model without ``--tokenizer``) the
    letters are read by their text from the top log-probabilities the server returns, and pairs
    are ordered by characters instead of tokens.

    Raises:
        ConfigError: unknown style or swap, ``repeats > 1`` with the ``explain`` style, or a
            tokenizer whose ``A`` / ``B`` are not single tokens after ``[[``.
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
        swap: str = "relabel",
        labels: str = "slot",
        calibrate: str = "none",
    ):
        check_judge_settings(style, repeats, swap, labels, calibrate)
        self.swap = swap
        self.labels = labels
        self.calibrate = calibrate
        #: the content-free letter prior ``(p_cf(A), p_cf(B))`` per letter layout: ``"AB"`` /
        #: ``"BA"``, ``+reference`` for prompts with a reference block
        self.priors: dict[str, tuple[float, float]] = {}
        self.prior_passes = 0
        self.backend = backend
        self.style = style
        self.max_new_tokens = max_new_tokens or (256 if style == "explain" else 4)
        self.repeats = repeats
        self.tie_margin = tie_margin
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.prefix = PREFIXES[style]
        if style == "verdict" and backend.has_tokenizer:
            self.token_a = letter_token(backend, self.prefix, "A")
            self.token_b = letter_token(backend, self.prefix, "B")

    def settings(self) -> dict:
        """What makes two judge runs comparable: backend identity plus the judge settings."""
        return {
            **self.backend.identity(),
            "style": self.style,
            "max_new_tokens": self.max_new_tokens,
            "repeats": self.repeats,
            "tie_margin": self.tie_margin,
            "swap": self.swap,
            "labels": self.labels,
            "calibrate": self.calibrate,
        }

    def prompt(
        self,
        question: str,
        first: str,
        second: str,
        reference: str | None,
        labels: tuple[str, str] = SLOT_LABELS,
    ) -> TaskPrompt:
        """This judge's prompt with ``first`` in the first slot (:func:`order_prompt`)."""
        return order_prompt(
            question, first, second, reference, self.style, self.max_new_tokens, labels
        )

    def letter_prior(self, layout: tuple[str, str], reference: bool) -> tuple[float, float]:
        """The content-free letter prior ``(p_cf(A), p_cf(B))`` of prompts laid out with the
        letters ``layout`` (with a reference block when ``reference``), computed on first use
        (one model pass per content-free input, counted in :attr:`prior_passes`) and kept in
        :attr:`priors`. The content-free input ``""`` leaves no reference block (as for a pair
        whose reference is empty).

        Raises:
            ConfigError: the judge put no mass on either letter for a content-free input.
        """
        key = "".join(layout) + ("+reference" if reference else "")
        if key not in self.priors:
            prompts = [
                self.prompt(cf, cf, cf, cf if reference else None, layout)
                for cf in CONTENT_FREE_INPUTS
            ]
            probs = [self._letter_probs(g) for g in self._generate(prompts)]
            self.prior_passes += len(prompts)
            if any(p is None for p in probs):
                raise ConfigError(
                    f"contextual calibration needs the letter probabilities, which "
                    f"{self.backend.model_name} does not return"
                )
            self.priors[key] = content_free_prior(probs)
        return self.priors[key]

    def _letter_probs(self, gen: Generation) -> tuple[float, float] | None:
        """``(p_A, p_B)`` at the verdict position: from the full first-step distribution, else
        from the top alternatives a server returned (read by their text, a letter not among
        them having probability 0); None without log-probabilities."""
        if gen.first_logprobs is not None:
            return letter_probs(gen.first_logprobs, self.token_a, self.token_b)
        top = gen.first_top_logprobs
        if top is None:
            return None
        return math.exp(top.get("A", -math.inf)), math.exp(top.get("B", -math.inf))

    def _order(
        self, gen: Generation, layout: tuple[str, str] = SLOT_LABELS, reference: bool = False
    ) -> OrderJudgment:
        """One order's judgment from its generation (letter probabilities and sampled verdicts
        from the first-step log-probabilities in the ``verdict`` style: the full distribution of
        a local backend, or the top alternatives a server returned, read by their text ``A`` /
        ``B``, a letter not among them having probability 0; none when the server returned no
        log-probabilities). A reply the backend flagged ``empty_answer`` or
        ``reasoning_unfinished`` keeps its reason in ``empty_reply_reason``. With calibration,
        ``q_a`` / ``q_b`` are the letter probabilities divided by the prior of the prompt's
        letter ``layout`` (:meth:`letter_prior`). All in letter terms (``p_a`` is the letter
        ``A``'s, wherever it stands).

        Raises:
            ConfigError: ``repeats > 1`` without the full first-step distribution.
        """
        why = next((gen.reasons.get(f) for f in _NO_REPLY if f in gen.flags), None)
        o = OrderJudgment(
            raw=gen.text,
            slot_verdict=parse_verdict(self.prefix + gen.text),
            empty_reply_reason=why,
        )
        if self.style != "verdict":
            return o
        lps = gen.first_logprobs
        if lps is None and self.repeats > 1:
            raise ConfigError(
                "repeats > 1 samples the verdict from the full next-token distribution, "
                f"which {self.backend.model_name} does not return; use repeats 1"
            )
        probs = self._letter_probs(gen)
        if probs is None:
            return o
        o.p_a, o.p_b = probs
        if self.calibrate != "none":
            q = contextual_calibration(probs, self.letter_prior(layout, reference))
            o.q_a, o.q_b = q if q is not None else (None, None)
        if self.repeats > 1:
            draws = torch.multinomial(
                lps.exp(), self.repeats, replacement=True, generator=self.generator
            )
            o.samples = [
                parse_verdict(self.prefix + self.backend.detokenize([int(t)])) for t in draws
            ]
        return o

    def _generate(self, prompts: list[TaskPrompt]) -> list[Generation]:
        """Greedy replies to ``prompts``, each with the first-step log-probabilities of exactly
        the input it was generated from (``verdict`` style). Where the backend reuses prefixes,
        the prompts are prefilled along their token trie in the given order (both orders of a
        pair share the prompt up to the first answer, pairs of one question share it up to the
        answers) and decoded :attr:`batch_size` at a time
        (:meth:`~ragfix.backends.hf.HFBackend.generate`): at 1 each order is decoded alone."""
        return self.backend.generate(
            prompts,
            batch_size=self.batch_size,
            max_new_tokens=self.max_new_tokens,
            stop_at_newline=False,
            first_logprobs=self.style == "verdict",
            prefix_reuse=True,
        )

    def _fits(self, tp: TaskPrompt, pair: JudgePair) -> Fit:
        """The window verdict of one order's prompt with the judge's answer budget: in the
        ``answer`` style the longer of the two scored replies (where the backend counts
        tokens here), else ``max_new_tokens``."""
        budget = self.max_new_tokens
        if self.style == "answer" and self.backend.has_tokenizer:
            budget = max(self.backend.count_tokens(" " + a) for a in (pair.answer_a, pair.answer_b))
        return self.backend.fit(tp, max_new_tokens=budget)

    def _score_answers(
        self,
        chunk: list[
            tuple[JudgePair, tuple[TaskPrompt, TaskPrompt], tuple[tuple[str, str], tuple[str, str]]]
        ],
    ) -> list[tuple[OrderJudgment, OrderJudgment]]:
        """Both orders of each pair of ``chunk`` (pair, its two prompts, their letter layouts)
        judged in the ``answer`` style, in letter terms: each order's two answers scored as the
        reply (one :meth:`~ragfix.backends.base.Backend.loglikelihood` call for the whole chunk,
        each prompt's two answers next to each other in slot order, so a backend reusing
        prefixes prefills the prompt once); ``p_a`` = ``1 / (1 + exp(ll_b - ll_a))``, the slot
        verdict the more likely letter (``tie`` when equal)."""
        queries = []
        for pair, both, _ in chunk:
            slots = ((pair.answer_a, pair.answer_b), (pair.answer_b, pair.answer_a))
            for tp, answers in zip(both, slots, strict=True):
                queries += [(tp, " " + a) for a in answers]
        scores = iter(self.backend.loglikelihood(queries))
        out = []
        for _, _, layouts in chunk:
            orders = []
            for lay in layouts:
                ll = dict(zip(lay, (next(scores), next(scores)), strict=True))
                p_a = 1.0 / (1.0 + math.exp(min(ll["B"] - ll["A"], 700.0)))
                verdict = "A" if ll["A"] > ll["B"] else "B" if ll["B"] > ll["A"] else "tie"
                orders.append(
                    OrderJudgment(
                        raw="",
                        slot_verdict=verdict,
                        p_a=p_a,
                        p_b=1.0 - p_a,
                        ll_a=ll["A"],
                        ll_b=ll["B"],
                    )
                )
            out.append((orders[0], orders[1]))
        return out

    def _identical(self, pair: JudgePair) -> PairJudgment:
        """Both orders of a pair with identical answers: a tie, without asking the model."""
        same = 0.5 if self.style == "verdict" else None
        cal = same if self.calibrate != "none" else None
        tie = OrderJudgment(raw="", slot_verdict="tie", p_a=same, p_b=same, q_a=cal, q_b=cal)
        return combine(pair, tie, tie, self.tie_margin)

    def judge_pairs(
        self,
        pairs: Sequence[JudgePair],
        on_result: Callable[[PairJudgment], None] | None = None,
    ) -> list[PairJudgment]:
        """Judge ``pairs`` in both orders, ``batch_size`` prompts per batch (both orders of a
        pair in one call; at ``batch_size`` 1 each decoded alone). Where the backend reuses
        prefixes, pairs are grouped by question (and reference), so a batch's prompts share their
        longest prefixes; elsewhere they are sorted by prompt length to limit padding.

        Pairs with identical answers are not sent to the model: both orders are a tie (flagged
        ``identical_answers``).

        Each order's prompt is checked against the window first (:meth:`Backend.fit
        <ragfix.backends.Backend.fit>`, the judge's ``max_new_tokens`` as the budget): a pair
        with an order that does not fit is not sent to the model and its record is flagged
        ``overflow`` (:func:`~ragfix.judge.verdicts.overflowed`; left out of every metric by
        :func:`~ragfix.judge.summarize`). So is a pair whose prompt the backend could not count
        here (a remote model without a tokenizer) when the server refused it as too long, or
        counted more prompt tokens than the window leaves. With a backend that cuts long
        prompts by design (``truncated``) such a pair is judged on the cut prompts and flagged
        ``cut_to_window``.

        A reply without text (a remote model's answer flagged ``empty_answer``, e.g. a
        reasoning model's ``content: null``) is an ``"invalid"`` order verdict; its
        :class:`~ragfix.judge.verdicts.OrderJudgment` keeps the server's reason
        (``empty_reply_reason``) and the pair is flagged ``empty_judge_reply``
        (:data:`~ragfix.judge.verdicts.EMPTY_JUDGE_REPLY`).

        Args:
            pairs: the pairs.
            on_result: called with each :class:`PairJudgment` as soon as it is done
                (:func:`ragfix.eval.run_judge` appends it to ``judgments.jsonl``).

        Returns:
            one :class:`PairJudgment` per pair, in order.

        Raises:
            Interrupted: Ctrl-C during a backend's ``generate`` that hands back the replies that
                had arrived (a remote model): every pair both of whose replies had arrived is
                judged and handed to ``on_result`` exactly as without the stop, then this is
                raised with ``done`` = the pairs this call finished, ``{pair index:
                PairJudgment}``. A pair with one reply only is not judged. (A backend that
                raises a plain ``KeyboardInterrupt`` loses its batch.)
        """
        results: dict[int, PairJudgment] = {}
        prompts: dict[int, tuple[TaskPrompt, TaskPrompt]] = {}
        layouts: dict[int, tuple[tuple[str, str], tuple[str, str]]] = {}
        fits: dict[int, tuple[Fit, Fit]] = {}

        def done(i: int, res: PairJudgment) -> None:
            results[i] = res
            if on_result is not None:
                on_result(res)

        for i, p in enumerate(pairs):
            if "identical_answers" in p.flags:
                done(i, self._identical(p))
                continue
            both = pair_prompts(p, self.style, self.swap, self.max_new_tokens, self.labels)
            fit = (self._fits(both[0], p), self._fits(both[1], p))
            if all(f.runs for f in fit):
                prompts[i], fits[i] = both, fit
                layouts[i] = pair_layouts(p, self.swap, self.labels)
            else:
                done(i, overflowed(p))
        size = self.backend.count_tokens if self.backend.has_tokenizer else len

        def key(i: int) -> tuple:
            shared = (pairs[i].question, pairs[i].reference or "")
            return (
                *(shared if self.backend.supports_prefix_reuse else ()),
                size(prompts[i][0].user),
            )

        def judged(i: int, both: tuple[Generation, Generation], share: float) -> None:
            """Pair ``i``'s record from its replies in the original and the swapped order
            (``share``: its seconds), handed to ``done``."""
            if any(_refused(f, g) for f, g in zip(fits[i], both, strict=True)):
                done(i, overflowed(pairs[i]))
                return
            flags = []
            if any(f in g.flags for g in both for f in _NO_REPLY):
                flags.append(EMPTY_JUDGE_REPLY)
            flags += sorted(
                {f for g in both for f in g.flags if f in (SERVED_MODEL_MISMATCH, INVALID_TEXT)}
            )
            orders = [
                self._order(g, lay, bool(pairs[i].reference))
                for g, lay in zip(both, layouts[i], strict=True)
            ]
            finish(i, orders, flags, share)

        def finish(i: int, orders: list[OrderJudgment], flags: list[str], share: float) -> None:
            """Pair ``i``'s record from its two orders in letter terms (flagged ``cut_to_window``
            where a prompt was cut, then ``flags``), handed to ``done``."""
            cut = [CUT_TO_WINDOW] if CUT_TO_WINDOW in (f.flag for f in fits[i]) else []
            slots = [
                in_slot_terms(o) if lay[0] == "B" else o  # A in the second slot
                for o, lay in zip(orders, layouts[i], strict=True)
            ]
            res = combine(pairs[i], *slots, self.tie_margin, cut + flags)
            res.seconds = share
            done(i, res)

        if self.calibrate != "none":  # the priors first: their passes are not a pair's time
            for i in prompts:
                for lay in layouts[i]:
                    self.letter_prior(lay, bool(pairs[i].reference))
        order = sorted(prompts, key=key)
        per_step = max(1, self.batch_size // 2)
        for start in range(0, len(order), per_step):
            chunk = order[start : start + per_step]
            began = time.perf_counter()
            if self.style == "answer":
                scored = self._score_answers([(pairs[i], prompts[i], layouts[i]) for i in chunk])
                share = (time.perf_counter() - began) / len(chunk)
                for i, both in zip(chunk, scored, strict=True):
                    finish(i, list(both), [], share)
                continue
            stop = None
            try:
                gens = dict(enumerate(self._generate([tp for i in chunk for tp in prompts[i]])))
            except Interrupted as e:  # Ctrl-C: the replies that had arrived
                gens, stop = e.done, e
            share = (time.perf_counter() - began) / len(chunk)
            for k, i in enumerate(chunk):
                if 2 * k in gens and 2 * k + 1 in gens:
                    judged(i, (gens[2 * k], gens[2 * k + 1]), share)
            if stop is not None:
                raise Interrupted(stop.message, done=results) from None
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
