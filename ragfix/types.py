"""Data models shared by connectors, backends, the sweep and the judge (pydantic v2)."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: flag of a cell (or a :class:`Generation`, or a judged pair) whose prompt does not fit the
#: model's window: not run, not scored
OVERFLOW = "overflow"
#: flag of a cell (or a judged pair) whose prompt does not fit the window of a backend that cuts
#: long prompts by design (``truncated``): run on the cut prompt and scored
CUT_TO_WINDOW = "cut_to_window"
#: flag of a remote answer whose prompt the server counted differently from the local tokenizer,
#: by no more than a cut would (a BOS token, a template's closing newline): scored
TOKEN_COUNT_MISMATCH = "token_count_mismatch"
#: flag of a remote answer whose prompt the server counted at more tokens fewer than the local
#: tokenizer than a count difference explains: the server cut the prompt; not scored
PROMPT_CUT = "prompt_cut"
#: flag of a remote answer without text (``content: null`` or blank): the server's reason
#: (``finish_reason``, a ``reasoning_content`` field, a refusal) is in the reasons; not scored
EMPTY_ANSWER = "empty_answer"
#: flag of an answer that opened a reasoning block (``<think>``) and stopped before closing it:
#: it has no final answer (:func:`ragfix.backends.base.final_answer`); not scored
REASONING_UNFINISHED = "reasoning_unfinished"
#: flag of a remote answer that came from another model than the one asked for (a gateway that
#: routed the request elsewhere): the name it answered with is in the reasons; not scored
SERVED_MODEL_MISMATCH = "served_model_mismatch"
#: flag of a remote answer that is not valid text (lone UTF-16 surrogates in its JSON): each
#: was replaced by U+FFFD, their count is in the reasons; not scored
INVALID_TEXT = "invalid_text"
#: what each flag of a cell that is not scored means, for the lines under the flags table
UNSCORED_MEANING = {
    OVERFLOW: "the prompt does not fit the context window",
    PROMPT_CUT: "the server cut the prompt",
    EMPTY_ANSWER: "the server gave no answer text",
    REASONING_UNFINISHED: "the model's reasoning never closed: no final answer",
    SERVED_MODEL_MISMATCH: "the server answered with another model than the one asked for",
    INVALID_TEXT: "the server's answer was not valid text",
}
#: the flags of a cell that is counted but not scored: its sample is left out of the accuracy at
#: every position (:func:`ragfix.eval.sweep.summary_counts`)
UNSCORED = frozenset(UNSCORED_MEANING)


class Passage(BaseModel):
    """One retrieved passage (a document of the multi-document QA prompt, or one KV pair).

    For KV retrieval, ``title`` is the key and ``text`` the value.
    """

    model_config = ConfigDict(frozen=True)

    title: str = ""
    text: str
    is_gold: bool = False
    id: str | None = None


class QASample(BaseModel):
    """A question with its gold passage and an ordered list of distractors.

    The distractor order is fixed per sample, so :meth:`passages_with_gold_at` changes only the
    gold passage's position ("same distractors, same order, for every position").

    Attributes:
        id: stable sample id (a hash of the question and, for KV, the key).
        task: a registered task name (:mod:`ragfix.tasks`): ``"qa"`` (Lost-in-the-Middle
            multi-document QA), ``"kv"`` (KV retrieval), or one registered later.
        question: the question (for KV, the key).
        answers: accepted gold answers (for KV, the value).
        gold: the gold passage.
        distractors: ``num_docs - 1`` distractor passages, in their fixed order.
        source: ``"file:line"`` the sample was read from.
    """

    id: str
    task: str = "qa"
    question: str
    answers: list[str] = Field(min_length=1)
    gold: Passage
    distractors: list[Passage]
    source: str = ""

    @property
    def num_docs(self) -> int:
        """Number of passages in the context (distractors plus the gold one)."""
        return len(self.distractors) + 1

    def passages_with_gold_at(self, position: int) -> list[Passage]:
        """The context with the gold passage at 0-based ``position``.

        Raises:
            ValueError: ``position`` is outside ``0 .. num_docs - 1``.
        """
        if not 0 <= position < self.num_docs:
            raise ValueError(
                f"gold position {position} out of range 0..{self.num_docs - 1} "
                f"for {self.num_docs} documents"
            )
        return [*self.distractors[:position], self.gold, *self.distractors[position:]]


class Generation(BaseModel):
    """One model output.

    Attributes:
        text: the generated text (cut at the first newline when the task stops there).
        prompt_tokens: tokens in the prompt.
        new_tokens: tokens generated.
        prefill_tokens: prompt tokens actually computed (fewer than ``prompt_tokens`` when a cached
            prefix was reused).
        seconds: wall time for this output (for a batch, the batch time divided by its size).
        first_logprobs: when asked for, the first answer step's next-token log-probabilities
            (float32 ``[vocab_size]`` tensor on the CPU); not serialised.
        token_ids: the generated token ids (``new_tokens`` of them: padding dropped, a stop
            token kept) from a local backend, ``None`` from a remote one; not serialised.
        first_top_logprobs: when asked for from a backend that sees only the most likely
            tokens (a remote model), the first answer step's top alternatives as ``{token text:
            log-probability}``; ``None`` from a local backend, or when the server returned no
            log-probabilities.
        usage: the server's own token counts (``prompt_tokens``, ``completion_tokens``) for a
            remote answer; ``None`` for a local one or a server that reports none.
        flags: what the backend knows makes this answer unlike an ordinary one:
            :data:`OVERFLOW` (the server refused the prompt as longer than its window: no
            answer), :data:`TOKEN_COUNT_MISMATCH` (the server counted a few other prompt tokens
            than the local tokenizer), :data:`PROMPT_CUT` (the server counted many fewer: it
            cut the prompt), :data:`EMPTY_ANSWER` (the server returned no answer text),
            :data:`REASONING_UNFINISHED` (the answer's reasoning block never closed: no final
            answer), :data:`SERVED_MODEL_MISMATCH` (the server answered with another model),
            :data:`INVALID_TEXT` (the server's answer was not valid text).
        reasons: what the server said behind a flag, by flag (``{"empty_answer":
            "content null, finish_reason stop, reasoning_content present"}``).
        votes: an answer over several orders of the passages
            (:class:`~ragfix.backends.orders.OrderMarginalBackend`): each order's ``order``,
            ``answer``, ``confidence`` and ``flags``; ``None`` for an answer read in one order.
        answer_tokens: the tokens of the answer itself where ``new_tokens`` counts more (an
            answer over several orders: ``new_tokens`` is every order's, what it cost); ``None``:
            ``new_tokens`` (:attr:`own_tokens`).
        raw_text: a remote model's answer as its server returned it (``text`` is that after
            :func:`~ragfix.backends.base.final_answer`), what ``ragfix serve`` passes on;
            ``None`` for a local answer (its text decoded from ``token_ids``).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    text: str
    prompt_tokens: int
    new_tokens: int
    prefill_tokens: int
    seconds: float
    first_logprobs: Any = Field(default=None, exclude=True, repr=False)
    token_ids: list[int] | None = Field(default=None, exclude=True, repr=False)
    first_top_logprobs: dict[str, float] | None = Field(default=None, exclude=True, repr=False)
    usage: dict[str, int] | None = None
    flags: list[str] = Field(default_factory=list)
    reasons: dict[str, str] = Field(default_factory=dict)
    votes: list[dict] | None = None
    answer_tokens: int | None = Field(default=None, exclude=True, repr=False)
    raw_text: str | None = Field(default=None, exclude=True, repr=False)

    @property
    def own_tokens(self) -> int:
        """The tokens of the answer given (what a client's ``max_tokens`` bounds and its
        ``usage.completion_tokens`` counts): :attr:`answer_tokens`, else :attr:`new_tokens`."""
        return self.new_tokens if self.answer_tokens is None else self.answer_tokens


def generation_extra(gen: Generation) -> dict:
    """What a record keeps of a generation besides its text and counts: a remote answer's usage
    figures (``usage``), the server's reason behind each of its flags (``{flag: reason}``,
    :attr:`Generation.reasons`) and, for an answer over several orders of the passages, each
    order's answer (``votes``, :attr:`Generation.votes`)."""
    return {
        **({"usage": gen.usage} if gen.usage is not None else {}),
        **gen.reasons,
        **({"votes": gen.votes} if gen.votes is not None else {}),
    }


class StoredPrompt(BaseModel):
    """The prompt a cell's model read, as a record keeps it (``ragfix report --html`` shows it).

    Attributes:
        text: the text: a sweep's user turn (the filled task template; the chat template is
            the backend's, recorded in the run's identity), or the exact text a pipeline's LLM
            component sent to the model (chat template included).
        assistant_prefix: what the model read between the text and its answer: the assistant
            turn's prefill in a chat template, a base model's completion prefix
            (:meth:`~ragfix.prompts.TaskPrompt.answer_prefix`).
        passages: the character spans ``[start, end)`` of the passages in ``text``, in prompt
            order, non-overlapping (a pipeline's: the chunks found verbatim in the text).
        gold: the index in ``passages`` of the gold passage, or None when it is not among them.
    """

    text: str
    assistant_prefix: str = ""
    passages: list[tuple[int, int]] = Field(default_factory=list)
    gold: int | None = None


class SweepRecord(BaseModel):
    """One finished sweep cell, as stored (one JSON line) in ``results.jsonl``.

    ``position`` is the gold passage's prompt position (raw model) or its retrieval rank (when a
    reorder strategy is applied); ``prompt_position`` is always where it ended up in the prompt
    (-1: not in the prompt, or no prompt was run). A reference point of the sweep
    (:mod:`ragfix.eval.sweep`) has ``reference`` set (``closed-book``: no passage; ``oracle``:
    the gold passage alone), ``position`` -1 and ``num_docs`` 0 or 1; it is never part of a
    curve.

    ``flags`` name what makes the cell unlike an ordinary scored answer (counted per position in
    ``summary.json`` and the printed tables, see :mod:`ragfix.eval.sweep`):

    * ``overflow``: the prompt plus the answer budget is longer than the backend's
      ``context_window``; the model was not run (empty answer, ``new_tokens`` 0) and the
      sample is left out of the accuracy at every position.
    * ``cut_to_window``: the same, for a backend that cuts long prompts by design
      (``truncated``); the cell ran and is scored.
    * ``prompt_cut``, ``empty_answer`` (a remote model): the server cut the prompt, or returned
      no answer text (its reason in ``extra["empty_answer"]``); counted and left out of the
      accuracy like ``overflow`` (:data:`UNSCORED`). ``token_count_mismatch``: the server
      counted a few other prompt tokens; scored.
    * ``reasoning_unfinished`` (any backend): the model opened a reasoning block and stopped
      before closing it, so there is no final answer to score
      (:func:`ragfix.backends.base.final_answer`); left out of the accuracy like ``overflow``.
    * ``served_model_mismatch``, ``invalid_text`` (a remote model): the server answered as
      another model than the one asked for (its name in ``extra``), or sent text that is not
      valid Unicode (lone surrogates, replaced by U+FFFD); left out of the accuracy like
      ``overflow``.
    * ``degenerate_gold``: a gold answer normalises to nothing, to one character or to stopwords
      only (:func:`ragfix.metrics.degenerate_gold`; the reasons are in ``extra``); scored as
      usual, reported so a reader knows the metric is loose there.

    ``question`` and ``gold_answers`` are the sample's; ``prompt`` is what the model read (kept
    for an overflow cell too: the prompt that did not fit), or None when the run was made with
    ``log_prompts`` off (``--no-log-prompts``). Records written before ragfix kept them have
    none of the three.
    """

    cell_id: str
    sample_id: str
    position: int
    reference: str | None = None
    prompt_position: int
    num_docs: int
    backend: str
    strategy: str = "none"
    prompt_tokens: int
    prefill_tokens: int
    new_tokens: int
    answer: str
    correct: bool
    seconds: float
    flags: list[str] = Field(default_factory=list)
    extra: dict = Field(default_factory=dict)
    question: str | None = None
    gold_answers: list[str] | None = None
    prompt: StoredPrompt | None = None


class JudgePair(BaseModel):
    """One pair for a pairwise judge (read by :mod:`ragfix.connectors.pairwise`, judged by
    :class:`ragfix.judge.PairwiseJudge`).

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
