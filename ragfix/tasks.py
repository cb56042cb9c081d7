"""Tasks as data: one record per task, one registry (in the spirit of lm-evaluation-harness).

A :class:`Task` holds everything that turns a question and an ordered passage list into what a
backend reads (:class:`~ragfix.prompts.TaskPrompt`) and an answer into a score: the instruction,
the user-turn template, how one passage is rendered and how passages are joined, the assistant
prefix, the answer budget, the stop rule and the scorer. Every prompt of ragfix is built here:
the sweep (:func:`task_prompt`), attention sorting (:meth:`Task.user_turn` with a marker) and the
LlamaIndex text-QA prompt (:meth:`Task.llama_index_template`), so each template exists once.

Built in:

* ``qa``: multi-document question answering, scored by best_subspan_em (Lost in the Middle, Liu
  et al., TACL 2024, ``prompts/qa.prompt``; closed-book: ``prompts/closedbook_qa.prompt``);
* ``qa-extractive`` and ``qa-extractive-2shot``: extractive multi-document QA (the answer is a
  span of one passage, as in SQuAD): a short-answer instruction, and the same with two fixed
  demonstrations from the tune range of ``data/squad_dev_multidoc.jsonl.gz`` (the design of
  HELMET's RAG prompts for base models, Yen et al., arXiv 2410.02694); scored by
  best_subspan_em;
* ``kv``: key-value retrieval over a JSON object, scored by value containment (Lost in the
  Middle, ``prompts/kv_retrieval.prompt``).

Every task reads one data format (:attr:`Task.data_format`: ``qa`` or ``kv`` records), so a QA
file can be swept with any QA task (``ragfix eval FILE --task qa-extractive``). A task's prompt
with no passages is its closed-book form and with the gold passage alone its oracle form, the
two reference points of a sweep (:mod:`ragfix.eval.sweep`). A run records the task's
:meth:`Task.fingerprint` (the prompts it renders), so a run never resumes under an edited task.

A new task is one :func:`register_task` call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ragfix.errors import ConfigError
from ragfix.metrics import best_subspan_em, kv_match
from ragfix.prompts import CONTENT_FREE_QUERY, TaskPrompt
from ragfix.types import Passage, QASample

QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."
EXTRACTIVE_INSTRUCTION = (
    "Answer the question with a short phrase copied from the document that answers it (some "
    "documents are irrelevant)."
)
#: what joins the two copies of a repeated context or user turn (:attr:`Task.repeat`)
REPEAT_SEPARATOR = "\n\n"
#: what :func:`get_task` reads as a repeated variant of a task: ``NAME:repeat-MODE``
REPEAT_SUFFIX = ":repeat-"
#: the closed-book user turn of Lost in the Middle (``prompts/closedbook_qa.prompt``)
CLOSED_BOOK_TEMPLATE = "Question: {question}\nAnswer:"


def render_document(index: int, passage: Passage) -> str:
    """A QA passage: ``Document [i](Title: ...) text`` with a 1-based ``index``."""
    return f"Document [{index}](Title: {passage.title}) {passage.text}"


def render_kv_pair(index: int, passage: Passage) -> str:
    """A KV pair (key in ``title``, value in ``text``) as one JSON object member; ``index`` is
    unused (the JSON object is unnumbered)."""
    return f"{json.dumps(passage.title)}: {json.dumps(passage.text)}"


def kv_answer_prefix(key: str) -> str:
    """Assistant prefill for KV retrieval. Small chat models answer in format only when the
    assistant turn opens with the answer's first words (measured on SmolLM2-135M-Instruct)."""
    return f'The value of key {json.dumps(key)} is "'


def kv_completion_prefix(key: str) -> str:
    """Base-model form of KV retrieval: the value opens with its quote right after
    ``Corresponding value:`` (Liu et al., "Lost in the Middle", TACL 2024, Sec. 3)."""
    return ' "'


@dataclass(frozen=True)
class Demonstration:
    """A solved example shown before the question (few-shot): a question, its passages in
    prompt order and its answer, rendered by the task's own passage format.

    Attributes:
        question: the question.
        passages: the passages, in the order shown.
        answer: the answer the example gives.
        source: where it comes from (``file#record`` and the record's id), for the docs.
    """

    question: str
    passages: tuple[Passage, ...]
    answer: str
    source: str


def _no_prefix(question: str) -> str:
    return ""


def _same(question: str) -> str:
    return question


def _kv_score(answer: str, answers: Sequence[str]) -> bool:
    return kv_match(answer, answers[0])


@dataclass(frozen=True)
class Task:
    """A task as data.

    Attributes:
        name: registry name (``QASample.task``).
        instruction: the instruction at the head of the user turn.
        template: the user turn, with the fields ``{instruction}``, ``{context}`` (the rendered
            passages) and ``{question}`` (the rendered question).
        render_passage: ``(1-based index, passage) -> text`` of one passage.
        separator: what joins the rendered passages into ``{context}``.
        render_question: question -> the text put into ``{question}`` (e.g. a JSON-quoted key).
        assistant_prefix: question -> the text the assistant turn is prefilled with.
        completion_prefix: question -> what follows the filled template for a base model (no
            chat template): the template itself ends where the answer starts.
        max_new_tokens: answer budget (tokens).
        stop_at_newline: the answer ends at its first newline.
        scorer: ``(answer, gold answers) -> correct``.
        data_format: the records the task reads (``qa``: question, answers and passages;
            ``kv``: key-value records), :func:`ragfix.connectors.litm.detect_format`.
        demonstrations: solved examples put between the instruction and the context, each in
            the task's own format (``{context}`` then ``{question}`` and its answer).
        closed_book_template: the user turn without passages, with the fields ``{question}``
            and, optionally, ``{demonstrations}`` (each demonstration's question and answer,
            without its passages: a task that shows examples shows them closed-book too);
            ``None``: the template with an empty context.
        repeat: a prompt-level correction for a backend that reads the prompt as text (the
            plain model, an adapter, a remote one; :func:`resolve_task` refuses the methods
            that read the passages where the prompt says they are):
            ``passages`` puts the context twice, one copy after the other (JRT-Prompt, Arora
            et al., "Just read twice", arXiv 2407.05483), ``prompt`` the whole user turn twice
            (Leviathan et al., "Prompt repetition improves non-reasoning LLMs", arXiv
            2512.14982; the first copy ends before the answer cue, :meth:`_repeated`), each
            joined by :data:`REPEAT_SEPARATOR`; so every passage is read once
            more after all the others (``passages``) or after the question too (``prompt``), at
            about twice the prefill. The prompt's spans are those of both copies, in order.
            :func:`get_task` builds the variant ``NAME:repeat-MODE`` of a registered task.
    """

    name: str
    instruction: str
    template: str
    render_passage: Callable[[int, Passage], str]
    separator: str = "\n"
    render_question: Callable[[str], str] = _same
    assistant_prefix: Callable[[str], str] = _no_prefix
    completion_prefix: Callable[[str], str] = _no_prefix
    max_new_tokens: int = 32
    stop_at_newline: bool = True
    scorer: Callable[[str, Sequence[str]], bool] = best_subspan_em
    data_format: str = "qa"
    demonstrations: tuple[Demonstration, ...] = ()
    closed_book_template: str | None = None
    repeat: Literal["none", "passages", "prompt"] = "none"

    @property
    def head(self) -> str:
        """What precedes the context in ``{instruction}``: the instruction and, after a blank
        line each, the rendered demonstrations."""
        parts = [self.instruction]
        for d in self.demonstrations:
            context = "".join(self.passage_texts(d.passages))
            parts.append(
                f"{context}\n\nQuestion: {self.render_question(d.question)}\nAnswer: {d.answer}"
            )
        return "\n\n".join(parts)

    @property
    def once(self) -> Task:
        """The task without repetition: itself, or the registered task it repeats."""
        return self if self.repeat == "none" else get_task(self.name.partition(REPEAT_SUFFIX)[0])

    def fingerprint(self) -> str:
        """16 hex digits identifying what the task renders: its chat and completion prompts for
        a fixed probe (two passages, and none), its answer budget and stop rule, the name of
        its scorer and its repetition. Recorded in a run's configuration (an edited template,
        instruction or demonstration changes it; an edited scorer body does not: a scorer is
        changed by registering a new one under a new name)."""
        probe = [Passage(title="T0", text="a b"), Passage(title="T1", text="c d")]
        parts = [
            self.name,
            self.data_format,
            str(self.max_new_tokens),
            str(self.stop_at_newline),
            f"{self.scorer.__module__}.{self.scorer.__qualname__}",
            self.repeat,
        ]
        for passages in (probe, []):
            p = self.prompt("Q?", passages)
            parts += [p.user, p.assistant_prefix, str(p.completion_prefix)]
        return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]

    def passage_texts(self, passages: Sequence[Passage]) -> list[str]:
        """Each passage rendered with its 1-based index, the separator attached to every one but
        the last, so that ``"".join(...)`` is the ``{context}`` of :meth:`user_turn`."""
        last = len(passages) - 1
        return [
            self.render_passage(i + 1, p) + (self.separator if i < last else "")
            for i, p in enumerate(passages)
        ]

    def user_turn(self, question: str, passages: Sequence[Passage] | str) -> str:
        """The filled template; ``passages`` in prompt order, or a ready ``{context}`` string
        (e.g. a marker where attention sorting cuts the prompt); no passages: the closed-book
        form (:attr:`closed_book_template`), if the task has one. Repeated as
        :attr:`repeat` says."""
        question = self.render_question(question)
        if not isinstance(passages, str) and not passages and self.closed_book_template:
            demos = "".join(
                f"Question: {self.render_question(d.question)}\nAnswer: {d.answer}\n\n"
                for d in self.demonstrations
            )
            closed = self.closed_book_template.format(question=question, demonstrations=demos)
            return self._repeated(closed, self.closed_book_template)
        context = passages if isinstance(passages, str) else "".join(self.passage_texts(passages))
        return self._filled(context, question)

    def _filled(self, context: str, question: str) -> str:
        """The template filled with ``context`` and ``question`` as they are, repeated as
        :attr:`repeat` says."""
        if self.repeat == "passages" and context:
            context = context + REPEAT_SEPARATOR + context
        user = self.template.format(instruction=self.head, context=context, question=question)
        return self._repeated(user, self.template)

    def _repeated(self, user: str, template: str) -> str:
        """``user`` (filled from ``template``) as :attr:`repeat` says: for ``prompt``, a first
        copy without the answer cue (what ``template`` puts after ``{question}``, such as
        ``\nAnswer:``), the separator, then ``user`` whole: the cue is read once, where the
        answer follows it. A base model that continues the document would otherwise learn from
        the first copy that the cue is followed by the separator (Gemma 3 270M answered every
        question with an empty line)."""
        if self.repeat != "prompt":
            return user
        cue = template.rpartition("{question}")[2].format()
        return user.removesuffix(cue) + REPEAT_SEPARATOR + user

    def prompt(self, question: str, passages: Sequence[Passage] | str) -> TaskPrompt:
        """The :class:`TaskPrompt` of ``question`` with ``passages`` in the given order; given
        as passages (not a ready context string) it knows their spans
        (:attr:`TaskPrompt.passages`), the separator and its content-free forms
        (:attr:`TaskPrompt.no_query`, :attr:`TaskPrompt.no_content`)."""
        core = self._prompt(question, passages)
        if not core.passages:
            return core
        blank = [Passage(title="", text="") for _ in passages]
        return replace(
            core,
            no_query=self._prompt(CONTENT_FREE_QUERY, passages),
            no_content=self._prompt(CONTENT_FREE_QUERY, blank),
        )

    def _prompt(self, question: str, passages: Sequence[Passage] | str) -> TaskPrompt:
        user = self.user_turn(question, passages)
        spans: tuple[tuple[int, int], ...] = ()
        if not isinstance(passages, str) and passages:
            marker = "\x00"  # never in a template: where the context starts
            head = self.template.format(
                instruction=self.head,
                context=marker,
                question=self.render_question(question),
            ).split(marker)[0]
            start, out = len(head), []
            for i, p in enumerate(passages):
                text = self.render_passage(i + 1, p)
                out.append((start, start + len(text)))
                start += len(text) + len(self.separator)
            if self.repeat != "none":  # the second copy's spans: one context further on, or
                # the whole turn at the end (the first copy lacks the cue, so lengths differ)
                shift = (
                    len("".join(self.passage_texts(passages))) + len(REPEAT_SEPARATOR)
                    if self.repeat == "passages"
                    else len(user) - len(self.once.user_turn(question, passages))
                )
                out += [(a + shift, b + shift) for a, b in out]
            spans = tuple(out)
        return TaskPrompt(
            user=user,
            assistant_prefix=self.assistant_prefix(question),
            completion_prefix=self.completion_prefix(question),
            max_new_tokens=self.max_new_tokens,
            stop_at_newline=self.stop_at_newline,
            passages=spans,
            passage_separator=self.separator if spans else "",
            closed_book=not isinstance(passages, str) and not passages,
        )

    def score(self, answer: str, answers: Sequence[str]) -> bool:
        """Whether ``answer`` is correct for the gold ``answers``."""
        return bool(self.scorer(answer, answers))

    def placeholder_template(self, context: str, question: str) -> str:
        """The user turn with the instruction filled in and the given placeholders where the
        context and the question go (the question is inserted as it is, so this suits tasks
        whose ``render_question`` is the identity), repeated as :attr:`repeat` says."""
        return self._filled(context, question)

    def llama_index_template(self) -> str:
        """The user turn as a LlamaIndex text-QA prompt string: ``{context_str}`` where the
        passages go, ``{query_str}`` where the question goes."""
        return self.placeholder_template("{context_str}", "{query_str}")


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Register ``task`` under ``task.name`` (a later registration replaces an earlier one).

    Returns:
        ``task``.
    """
    _TASKS[task.name] = task
    return task


def task_names(data_format: str | None = None) -> list[str]:
    """The registered tasks, sorted; only those reading ``data_format`` records when given."""
    return sorted(n for n, t in _TASKS.items() if data_format in (None, t.data_format))


def run_task(config: dict) -> str:
    """The task whose prompt and scorer a run folder's records were made with, from its
    ``config.json``: a sweep's ``task``; a pipeline run's (``task: qa-pipeline``) ``qa_task``
    (``qa`` for a folder written before the field)."""
    task = str(config.get("task"))
    return str(config.get("qa_task") or "qa") if task == "qa-pipeline" else task


def repeated(task: Task, mode: str) -> Task:
    """``task`` read with its passages (``passages``) or its whole user turn (``prompt``)
    twice (:attr:`Task.repeat`), registered as ``NAME:repeat-MODE``; ``none``: ``task``.

    Raises:
        ConfigError: an unknown mode, or a task that is already repeated.
    """
    if mode == "none":
        return task
    if mode not in ("passages", "prompt"):
        raise ConfigError(f"unknown repetition {mode!r}; choose none, passages or prompt")
    if task.repeat != "none":
        raise ConfigError(f"task {task.name!r} is already repeated")
    return register_task(replace(task, name=f"{task.name}{REPEAT_SUFFIX}{mode}", repeat=mode))


def resolve_task(
    name: str | None, repeat: str, data_format: str, *, reads_passages: bool = False
) -> Task:
    """The task a run reads its records as: ``name`` (default: the data format's own task,
    ``qa`` or ``kv``), repeated as ``repeat`` says (:func:`repeated`).

    Args:
        name: a task name, a repeated variant ``NAME:repeat-MODE`` included, or ``None``.
        repeat: ``none``, ``passages`` or ``prompt``.
        data_format: the records' format (``qa``, ``kv``).
        reads_passages: the run's backend reads the passages where the prompt says they are
            (:attr:`~ragfix.backends.base.Backend.needs_passage_spans`: ``pine``,
            ``set-based``, ``attention-sort``, ``calibrated-attention``, order
            marginalization): a repeated prompt is refused, since such a backend would take the
            two copies for twice as many passages and set, sort or reorder them apart.

    Raises:
        ConfigError: an unknown task or repetition, a task of another data format, or a
            repeated task with ``reads_passages``.
    """
    task = repeated(get_task(name or data_format), repeat)
    if task.data_format != data_format:
        raise ConfigError(
            f"--task {task.name} reads {task.data_format} records and the data holds "
            f"{data_format} records; its tasks: {', '.join(task_names(data_format))}"
        )
    if task.repeat != "none" and reads_passages:
        raise ConfigError(
            f"task {task.name} reads its passages twice; a backend that acts on the passages "
            "where the prompt says they are (pine, set-based, attention-sort, "
            "calibrated-attention, --orders) would take the two copies for more passages: use "
            "--repeat with vanilla, an adapter or a served model"
        )
    return task


def get_task(name: str) -> Task:
    """The task registered under ``name``, or the repeated variant ``NAME:repeat-MODE`` of one
    (:func:`repeated`).

    Raises:
        ConfigError: unknown task (the message lists the known ones).
    """
    base, sep, mode = name.partition(REPEAT_SUFFIX)
    if name not in _TASKS and sep and base in _TASKS:
        return repeated(_TASKS[base], mode)
    if name not in _TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of: {', '.join(sorted(_TASKS))}")
    return _TASKS[name]


QA = register_task(
    Task(
        name="qa",
        instruction=QA_INSTRUCTION,
        template="{instruction}\n\n{context}\n\nQuestion: {question}\nAnswer:",
        render_passage=render_document,
        closed_book_template=CLOSED_BOOK_TEMPLATE,
    )
)
KV = register_task(
    Task(
        name="kv",
        instruction=KV_INSTRUCTION,
        template=(
            "{instruction}\n\nJSON data:\n{{{context}}}\n\nKey: {question}\nCorresponding value:"
        ),
        render_passage=render_kv_pair,
        separator=",\n ",
        render_question=json.dumps,
        assistant_prefix=kv_answer_prefix,
        completion_prefix=kv_completion_prefix,
        max_new_tokens=40,
        stop_at_newline=False,
        scorer=_kv_score,
        data_format="kv",
    )
)

#: the two demonstrations of ``qa-extractive-2shot``: records 721 and 729 of
#: data/squad_dev_multidoc.jsonl.gz (tune range, articles Super_Bowl_50 and Nikola_Tesla), each
#: with one short distractor of its article; the gold passage second in the first, first in the
#: second, so the examples favour no position
SQUAD_DEMONSTRATIONS = (
    Demonstration(
        question="What disease did Tesla catch?",
        passages=(
            Passage(
                title="Nikola Tesla",
                text="In 1899, John Jacob Astor IV invested $100,000 for Tesla to further develop "
                "and produce a new lighting system. Instead, Tesla used the money to fund his "
                "Colorado Springs experiments.",
            ),
            Passage(
                title="Nikola Tesla",
                text="In 1873, Tesla returned to his birthtown, Smiljan. Shortly after he arrived, "
                "Tesla contracted cholera; he was bedridden for nine months and was near death "
                "multiple times. Tesla's father, in a moment of despair, promised to send him to "
                "the best engineering school if he recovered from the illness (his father had "
                "originally wanted him to enter the priesthood).",
            ),
        ),
        answer="cholera",
        source="data/squad_dev_multidoc.jsonl.gz#729 (SQuAD 56e0c2307aa994140058e6e0)",
    ),
    Demonstration(
        question="Who is the commissioner of the NFL?",
        passages=(
            Passage(
                title="Super Bowl 50",
                text="In early 2012, NFL Commissioner Roger Goodell stated that the league planned "
                'to make the 50th Super Bowl "spectacular" and that it would be "an important '
                'game for us as a league".',
            ),
            Passage(
                title="Super Bowl 50",
                text="The Panthers used the San Jose State practice facility and stayed at the San "
                "Jose Marriott. The Broncos practiced at Stanford University and stayed at the "
                "Santa Clara Marriott.",
            ),
        ),
        answer="Roger Goodell",
        source="data/squad_dev_multidoc.jsonl.gz#721 (SQuAD 56d6edd00d65d21400198250)",
    ),
)
QA_EXTRACTIVE = register_task(
    Task(
        name="qa-extractive",
        instruction=EXTRACTIVE_INSTRUCTION,
        template="{instruction}\n\n{context}\n\nQuestion: {question}\nAnswer:",
        render_passage=render_document,
        closed_book_template="Answer the question with a short phrase.\n\n{demonstrations}"
        + CLOSED_BOOK_TEMPLATE,
    )
)
QA_EXTRACTIVE_2SHOT = register_task(
    replace(QA_EXTRACTIVE, name="qa-extractive-2shot", demonstrations=SQUAD_DEMONSTRATIONS)
)


CHUNK_TEMPLATE = "Document (Title: {title}) {text}"
"""How a retrieved chunk reads in a pipeline's prompt (the Lost-in-the-Middle document line)."""
CHUNK_SEPARATOR = "\n\n"
"""What joins the chunks of a pipeline's prompt."""


def render_chunk(title: str, text: str) -> str:
    """A retrieved chunk as the LLM reads it in a pipeline (LlamaIndex renders its nodes with the
    same template, :data:`CHUNK_TEMPLATE`): ``Document (Title: t) text``, or the bare text for a
    chunk without a title (as LlamaIndex leaves a node without metadata)."""
    return CHUNK_TEMPLATE.format(title=title, text=text) if title.strip() else text


def join_chunks(chunks: Sequence[str]) -> str:
    """The ``{context}`` of a pipeline's prompt: the rendered chunks, each stripped, blank ones
    left out, joined by :data:`CHUNK_SEPARATOR` (how LlamaIndex's ``compact`` synthesis packs a
    context that fits one prompt), so every framework gives the model the same text."""
    return CHUNK_SEPARATOR.join(c.strip() for c in chunks if c.strip())


def task_prompt(sample: QASample, passages: Sequence[Passage]) -> TaskPrompt:
    """The prompt for ``sample`` with its context in the given order (its task's record).

    Raises:
        ConfigError: ``sample.task`` is not a registered task.
    """
    return get_task(sample.task).prompt(sample.question, passages)


def score_answer(sample: QASample, answer: str) -> bool:
    """Score ``answer`` with the scorer of ``sample``'s task (best_subspan_em for QA, value
    containment for KV).

    Raises:
        ConfigError: ``sample.task`` is not a registered task.
    """
    return get_task(sample.task).score(answer, sample.answers)


__all__ = [
    "CHUNK_SEPARATOR",
    "Demonstration",
    "QA_EXTRACTIVE",
    "QA_EXTRACTIVE_2SHOT",
    "CHUNK_TEMPLATE",
    "KV",
    "KV_INSTRUCTION",
    "QA",
    "QA_INSTRUCTION",
    "Task",
    "get_task",
    "join_chunks",
    "kv_answer_prefix",
    "register_task",
    "render_chunk",
    "repeated",
    "run_task",
    "resolve_task",
    "render_document",
    "render_kv_pair",
    "score_answer",
    "task_names",
    "task_prompt",
]
