"""Order marginalization: answer over several orders of the same passages and aggregate
(permutation self-consistency, Tang et al., "Found in the Middle: Permutation Self-Consistency
Improves Listwise Ranking in Large Language Models", NAACL 2024, arXiv 2310.07712, Sec. 2).

The one correction that needs no access to the model's weights or attention: it wraps any
:class:`~ragfix.backends.base.Backend`, local or remote (``openai:NAME``), and works through the
interface alone. For each task prompt with passages it builds ``orders`` orders of them
(:func:`passage_orders`), asks the wrapped backend for the greedy answer to each
(:meth:`Backend.generate`, one call for all of them, with each answer's first-token
log-probabilities), and returns one answer per prompt (:func:`aggregate`). A prompt without
passage spans (a plain text) has one order and is answered as it is; a consumer whose prompts
never carry spans refuses the wrapper (:attr:`needs_passage_spans`).

Cost: ``orders`` times the decoding of one answer, and at most ``orders`` times its prefill
(less with prefix reuse: the orders of a call share the instruction and, for the cells of one
sample, runs of passages; the prompts of one call are sent together, so a remote server or a
GPU batch runs them in parallel).

Designs:

* ``rotate``: cyclic shifts of the passages, ``orders`` of them evenly spaced (shift
  ``floor(k * n / orders)`` for ``k < orders``, distinct ones only). With ``orders`` = ``n``
  every passage takes every position exactly once (a Latin square: a balanced design).
* ``shuffle``: ``orders`` seeded random permutations (the paper's), the first the order as
  given; the seed is mixed with the prompt's text so a prompt gets the same orders in any batch.

Aggregators (each order's answer normalised by :func:`ragfix.metrics.normalize_answer`):

* ``plurality``: the most frequent answer (the paper's aggregation for a single answer); a tie
  goes to the answer with the higher mean confidence.
* ``weighted``: the answer with the largest sum of confidences ``exp(c)`` over the orders that
  gave it (a vote weighted by the model's probability).
* ``max``: the answer of the single most confident order.
* ``score``: each distinct answer (a candidate) scored under every order, the answer with the
  largest mean log-likelihood over the orders (:meth:`Backend.loglikelihood` of the candidate
  after each order's prompt: ``K x C`` more scorings for ``C`` candidates, each a prefill of
  the order's prompt where the backend cannot reuse it). Under a balanced design every passage
  takes every position equally often, so the position's share of a candidate's score is the
  same for every candidate and what differs is how well the passages support it (the issue
  with ``max``: one order's confidence carries that order's position bias). Each vote keeps
  its order's ``scores`` (``{normalised candidate: log-likelihood}``) so a smaller number of
  orders is re-scored from the same run.
* ``score-max``: the same scores, the answer with the largest log-likelihood under any one
  order (the whole answer's, where ``max`` reads only the first token of the answer each order
  gave).

The confidence ``c`` of an order's answer is the log-probability of its first token (where
greedy decoding commits to the passage it copies from): from a local backend, the largest of
``Generation.first_logprobs``; from a remote one, the largest of its ``first_top_logprobs``. An
order without it (a server that returns no log-probabilities) counts with confidence 0 for
``plurality`` and is refused for ``weighted`` and ``max`` (:class:`ConfigError`); ``score``
needs a backend that scores text (a local one, or a server that answers completions ``echo``
with ``logprobs``, :class:`~ragfix.backends.remote.RemoteBackend`).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from ragfix.backends.base import Backend, BackendOptions, Cancel, Fit, Prompt
from ragfix.errors import ConfigError
from ragfix.metrics import normalize_answer
from ragfix.prompts import TaskPrompt
from ragfix.types import UNSCORED, Generation

if TYPE_CHECKING:
    import torch

#: the aggregators that score each candidate answer under every order (:func:`aggregate`)
SCORED = frozenset({"score", "score-max"})


class OrderOptions(BackendOptions):
    """Settings of order marginalization (``--orders K --orders-design D --orders-aggregate A``).

    Attributes:
        orders: orders per prompt (``K >= 2``); a prompt with fewer passages than the design
            can order differently gets the distinct ones only (``rotate``: at most ``n``).
        design: ``rotate`` (evenly spaced cyclic shifts; the design tuned: every number of
            its orders is scored from one run) or ``shuffle`` (seeded permutations, the
            paper's; not measured here).
        aggregate: ``plurality``, ``weighted``, ``max``, ``score`` or ``score-max`` (module
            docstring); the default, ``score-max``, is the best worst position on the tune
            range (SmolLM2-135M, KV-8, records 0-4 of the 140-key file: ``ragfix tune
            orders``, results/kv8-tune5-orders-score.json); it needs a backend that scores
            text, else use ``max`` (first-token log-probabilities) or ``plurality``.
        seed: the ``shuffle`` design's seed.
    """

    orders: int = Field(ge=2)
    design: Literal["rotate", "shuffle"] = "rotate"
    aggregate: Literal["plurality", "weighted", "max", "score", "score-max"] = "score-max"
    seed: int = 0


def distinct_orders(n: int, design: str, most: int) -> int:
    """How many distinct orders of ``n`` passages ``design`` can give, counted up to ``most``
    (``rotate``: ``n`` cyclic shifts; ``shuffle``: ``n!`` permutations, its product stopped
    past ``most``, so a large ``n`` costs at most ``most`` steps); 1 for ``n < 2``."""
    if n < 2:
        return 1
    if design == "rotate":
        return n
    count = 1
    for k in range(2, n + 1):
        count *= k
        if count > most:
            break
    return count


def check_orders(options: OrderOptions, n: int) -> None:
    """Refuse ``options`` for prompts of ``n`` passages when its design has fewer distinct
    orders than ``options.orders`` (the answers would hold fewer votes than asked, silently).

    Raises:
        ConfigError: one line naming ``--orders``, ``n`` and the design's count.
    """
    have = distinct_orders(n, options.design, options.orders)
    if have < options.orders:
        raise ConfigError(
            f"--orders {options.orders}: {n} passages have only {have} distinct orders under "
            f"--orders-design {options.design}: give --orders {have} or fewer"
            + (" (or --orders-design shuffle)" if options.design == "rotate" and n > 2 else "")
        )


def passage_orders(n: int, options: OrderOptions, key: str = "") -> list[tuple[int, ...]]:
    """The orders of ``n`` passages a prompt is answered over, the first the order as given.

    Args:
        n: passages in the prompt.
        options: the design, the number of orders and the seed.
        key: mixed into the ``shuffle`` seed (the prompt's text), so the orders of a prompt do
            not depend on what it is batched with.

    Returns:
        distinct permutations of ``range(n)`` (``order[j]`` = the passage put at position
        ``j``); one, the identity, when ``n < 2``.
    """
    identity = tuple(range(n))
    if n < 2:
        return [identity]
    if options.design == "rotate":
        shifts = dict.fromkeys(k * n // options.orders for k in range(options.orders))
        return [tuple((j + s) % n for j in range(n)) for s in shifts]
    digest = hashlib.sha256(f"{options.seed}\0{key}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    out = {identity: None}  # insertion-ordered, a set's lookup: linear in the orders drawn
    tries = 0
    while len(out) < min(options.orders, math.factorial(n)) and tries < 100 * options.orders:
        out.setdefault(tuple(rng.sample(range(n), n)))
        tries += 1
    return list(out)


def confidence(gen: Generation) -> float | None:
    """The log-probability (nats) of ``gen``'s first answer token: the largest first-step
    log-probability (greedy decoding takes the most likely token), from
    ``first_logprobs`` (local) or ``first_top_logprobs`` (remote); ``None`` when the backend
    gave neither or the answer is empty."""
    if not gen.text:
        return None
    if gen.first_logprobs is not None:
        return float(gen.first_logprobs.max())
    if gen.first_top_logprobs:
        return max(gen.first_top_logprobs.values())
    return None


def aggregate(
    answers: Sequence[tuple[str, float | None]],
    how: str,
    scores: Sequence[dict[str, float] | None] | None = None,
) -> int:
    """Which of the orders' answers is the marginal answer.

    Args:
        answers: each order's ``(answer, confidence)`` (:func:`confidence`), in order; an empty
            answer is never chosen unless all are empty.
        how: ``plurality``, ``weighted``, ``max``, ``score`` or ``score-max``.
        scores: for ``score`` and ``score-max``, each order's ``{normalised answer:
            log-likelihood}`` of every candidate (:func:`candidates`) under that order's prompt.

    Returns:
        the index in ``answers`` of the chosen answer: of its answer class, the order with the
        highest confidence (the first of equals); the one answer that votes, by any aggregate.

    Raises:
        ConfigError: ``weighted`` or ``max`` with an answer that has no confidence; ``score``
            or ``score-max`` without an order's score of a candidate.
    """
    voting = [i for i, (text, _) in enumerate(answers) if normalize_answer(text)]
    if len(voting) < 2:  # nothing to weigh (one order: a prompt with one passage)
        return voting[0] if voting else 0
    if how in ("weighted", "max") and any(answers[i][1] is None for i in voting):
        raise ConfigError(
            f"--orders-aggregate {how} needs each answer's log-probability, and the backend "
            "gave none (a server without logprobs): use --orders-aggregate plurality"
        )
    conf = {i: answers[i][1] if answers[i][1] is not None else 0.0 for i in voting}
    classes: dict[str, list[int]] = {}
    for i in voting:
        classes.setdefault(normalize_answer(answers[i][0]), []).append(i)
    if how in SCORED and (
        scores is None or any(s is None or not classes.keys() <= s.keys() for s in scores)
    ):
        raise ConfigError(
            f"--orders-aggregate {how} needs every candidate's log-likelihood under every order "
            "(votes recorded with --orders-aggregate score or score-max)"
        )

    def score(name: str) -> tuple[float, ...]:
        members = classes[name]
        mean = sum(conf[i] for i in members) / len(members)
        if how == "plurality":
            return (len(members), mean)
        if how == "weighted":
            return (sum(math.exp(conf[i]) for i in members),)
        if how == "score":
            return (sum(s[name] for s in scores) / len(scores),)
        if how == "score-max":
            return (max(s[name] for s in scores),)
        return (max(conf[i] for i in members),)

    best = classes[max(classes, key=score)]
    return max(best, key=lambda i: (conf[i], -i))


def candidates(answers: Sequence[tuple[str, float | None]]) -> dict[str, str]:
    """The distinct answers of the orders, ``{normalised answer: text}`` (the text of the
    most confident order that gave it, the first of equals); empty answers left out."""
    best: dict[str, tuple[float, str]] = {}
    for text, conf in answers:
        name = normalize_answer(text)
        c = conf if conf is not None else 0.0
        if name and (name not in best or c > best[name][0]):
            best[name] = (c, text)
    return {name: text for name, (_, text) in best.items()}


def _ballot(v: dict) -> tuple[str, float | None]:
    """A vote's ``(answer, confidence)``, the answer empty when an UNSCORED flag is set."""
    return ("" if UNSCORED.intersection(v["flags"]) else v["answer"], v["confidence"])


def choose(votes: Sequence[dict], how: str) -> int:
    """The index of the marginal answer among ``votes`` (each order's ``answer``,
    ``confidence``, ``flags`` and, scored, ``scores``, as :attr:`Generation.votes` and a sweep
    record's ``extra["votes"]`` hold them): :func:`aggregate` over the answers, an answer with
    an :data:`~ragfix.types.UNSCORED` flag (``empty_answer``, ``overflow``) not voting.

    Raises:
        ConfigError: see :func:`aggregate`.
    """
    return aggregate([_ballot(v) for v in votes], how, [v.get("scores") for v in votes])


class OrderMarginalBackend(Backend):
    """A backend answering over several orders of each prompt's passages (module docstring).

    Everything but :meth:`generate` and :meth:`fit` is the wrapped backend's: its name, model,
    window, tokenizer and scores. :meth:`identity` is the wrapped one's plus ``orders`` (the
    settings), so a run with other orders is never resumed onto.

    Raises:
        ConfigError: a :data:`SCORED` aggregator over a backend without a tokenizer here (a
            served model without ``--tokenizer``: its prompts could not be formatted to score).
    """

    needs_passage_spans = True

    def __init__(self, inner: Backend, options: OrderOptions):
        if options.aggregate in SCORED and not inner.has_tokenizer:
            raise ConfigError(
                f"--orders-aggregate {options.aggregate} scores each candidate answer after "
                "each order's prompt, formatted here with the model's tokenizer: give "
                "--tokenizer NAME, or choose --orders-aggregate max or plurality"
            )
        self.inner = inner
        self.options = options
        self.name = inner.name
        self.supports_prefix_reuse = inner.supports_prefix_reuse
        self.has_tokenizer = inner.has_tokenizer
        self.cuts_long_prompts = inner.cuts_long_prompts
        self.preferred_batch_size = inner.preferred_batch_size

    # what the wrapped backend is
    @property
    def context_window(self) -> int:
        return self.inner.context_window

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def device(self) -> torch.device | None:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype | None:
        return self.inner.dtype

    @property
    def reads_chat_template(self) -> bool:
        return self.inner.reads_chat_template

    def identity(self) -> dict:
        return {**self.inner.identity(), "orders": self.options.model_dump(mode="json")}

    def format_prompt(self, prompt: Prompt) -> str:
        return self.inner.format_prompt(prompt)

    def tokenize(self, text: str) -> list[int]:
        return self.inner.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.inner.detokenize(ids)

    def forget_prompts(self) -> None:
        self.inner.forget_prompts()

    def next_token_logprobs(self, prompts: Sequence[Prompt], *, batch_size: int = 8):
        return self.inner.next_token_logprobs(prompts, batch_size=batch_size)

    def token_logprobs(self, ids: Sequence[int]):
        return self.inner.token_logprobs(ids)

    def loglikelihood(self, pairs: Sequence[tuple[Prompt, str]]) -> list[float]:
        return self.inner.loglikelihood(pairs)

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 256,
        stop_at_newline: bool = False,
        cancel: Cancel | None = None,
    ) -> Generator[str, None, int]:
        """The marginal answer as one piece, once every order has answered: the chosen
        answer's text as generated (its tokens decoded; a remote model's text as its server
        returned it), as a stream of the wrapped backend sends it; returns
        (``StopIteration.value``) that answer's own tokens (:attr:`Generation.own_tokens`), so
        a server's stream ends as the answer not streamed."""
        gen = self.generate(
            [prompt], max_new_tokens=max_new_tokens, stop_at_newline=stop_at_newline, cancel=cancel
        )[0]
        if gen.token_ids is not None:
            yield self.detokenize(gen.token_ids)
        else:
            yield gen.text if gen.raw_text is None else gen.raw_text
        return gen.own_tokens

    # what it changes
    def orders_of(self, prompt: Prompt) -> list[tuple[int, ...]]:
        """The orders ``prompt`` is answered over (:func:`passage_orders`)."""
        n = len(prompt.passages) if isinstance(prompt, TaskPrompt) else 0
        key = prompt.user if isinstance(prompt, TaskPrompt) else prompt
        return passage_orders(n, self.options, key)

    def _ordered(self, prompt: Prompt) -> list[Prompt]:
        orders = self.orders_of(prompt)
        if len(orders) == 1:
            return [prompt]
        return [prompt.reordered(o) for o in orders]

    def fit(self, prompt: Prompt, max_new_tokens: int | None = None) -> Fit:
        """The wrapped backend's verdict on the longest of ``prompt``'s orders (a permutation
        can tokenize a few tokens longer at the passage boundaries)."""
        fits = [self.inner.fit(p, max_new_tokens) for p in self._ordered(prompt)]
        if any(f.prompt_tokens is None for f in fits):
            return fits[0]
        return max(fits, key=lambda f: f.prompt_tokens)

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        batch_size: int = 8,
        max_new_tokens: int | None = None,
        stop_at_newline: bool | None = None,
        first_logprobs: bool = False,
        prefix_reuse: bool = False,
        cancel: Cancel | None = None,
    ) -> list[Generation]:
        """One marginal answer per prompt. With ``prefix_reuse`` (where the wrapped backend
        supports it) the orders of all ``prompts`` run in the lexicographic order of their text
        over the wrapped backend's prefix reuse, so a prefix that several orders share (the
        instruction, the passages before the first moved one) is prefilled once.

        Each returned :class:`Generation` is the chosen order's, with ``prompt_tokens`` the
        longest order's (what the window must hold), ``prefill_tokens``, ``new_tokens`` and
        ``seconds`` summed over all orders and the scoring (what the answer cost),
        ``answer_tokens`` the chosen answer's own, and ``votes``:
        per order, its ``order``, ``answer``, ``confidence``, ``flags`` and, with a
        :data:`SCORED` aggregator, ``scores``. An order whose answer is not a
        measurement (an :data:`~ragfix.types.UNSCORED` flag such as ``empty_answer``) does
        not vote; when none votes, the first order's answer and flags are returned.

        Raises:
            ConfigError: see :func:`aggregate`.
            Cancelled: as the wrapped backend's.
        """
        ordered = [self._ordered(prompt) for prompt in prompts]
        expanded = [(i, p) for i, each in enumerate(ordered) for p in each]
        reuse = prefix_reuse and self.inner.supports_prefix_reuse
        run = list(range(len(expanded)))
        if reuse:  # a depth-first order of the prompts' trie: each shared prefix computed once
            run.sort(key=lambda j: self.inner.format_prompt(expanded[j][1]))
        gens = self.inner.generate(
            [expanded[j][1] for j in run],
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            stop_at_newline=stop_at_newline,
            first_logprobs=True,
            prefix_reuse=reuse,
            cancel=cancel,
        )
        answered: list[Generation | None] = [None] * len(expanded)
        for j, gen in zip(run, gens, strict=True):
            answered[j] = gen
        by_prompt: list[list[Generation]] = [[] for _ in prompts]
        for (i, _), gen in zip(expanded, answered, strict=True):
            by_prompt[i].append(gen)
        return [
            self._marginal(prompt, each, answers, first_logprobs)
            for prompt, each, answers in zip(prompts, ordered, by_prompt, strict=True)
        ]

    def _scores(self, ordered: list[Prompt], votes: list[dict]) -> float:
        """Put each order's ``scores`` into ``votes`` (a :data:`SCORED` aggregator): every candidate
        (:func:`candidates`) scored after every order's prompt, the orders in the order of
        their text so a prefix-reusing backend prefills what they share once; returns the
        seconds it took."""
        start = time.perf_counter()
        names = candidates([_ballot(v) for v in votes])
        run = sorted(range(len(ordered)), key=lambda k: self.inner.format_prompt(ordered[k]))
        pairs = [(ordered[k], text) for k in run for text in names.values()]
        values = iter(self.inner.loglikelihood(pairs) if pairs else [])
        for k in run:
            votes[k]["scores"] = {name: round(next(values), 4) for name in names}
        return time.perf_counter() - start

    def _marginal(
        self, prompt: Prompt, ordered: list[Prompt], gens: list[Generation], first_logprobs: bool
    ) -> Generation:
        votes = [
            {
                "order": list(o),
                "answer": g.text,
                "confidence": None if (c := confidence(g)) is None else round(c, 4),
                "flags": list(g.flags),
            }
            for o, g in zip(self.orders_of(prompt), gens, strict=True)
        ]
        scoring = 0.0
        if self.options.aggregate in SCORED and len(gens) > 1:
            scoring = self._scores(ordered, votes)
        chosen = gens[choose(votes, self.options.aggregate)]
        return chosen.model_copy(
            update={
                "prompt_tokens": max(g.prompt_tokens for g in gens),
                "prefill_tokens": sum(g.prefill_tokens for g in gens),
                "new_tokens": sum(g.new_tokens for g in gens),
                "answer_tokens": chosen.own_tokens,
                "seconds": sum(g.seconds for g in gens) + scoring,
                "first_logprobs": chosen.first_logprobs if first_logprobs else None,
                "votes": votes if len(gens) > 1 else None,
            }
        )


def marginalize_orders(backend: Backend, options: OrderOptions | None) -> Backend:
    """``backend`` answering over ``options.orders`` orders of each prompt's passages, or
    ``backend`` itself when ``options`` is ``None``."""
    return backend if options is None else OrderMarginalBackend(backend, options)


__all__ = [
    "OrderMarginalBackend",
    "OrderOptions",
    "SCORED",
    "aggregate",
    "candidates",
    "choose",
    "confidence",
    "marginalize_orders",
    "passage_orders",
]
