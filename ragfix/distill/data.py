"""Pos2Distill training data: prompts with the gold passage(s) moved, the teacher's answers, and
the rows built from the correct ones (arXiv 2508.15709, sections 3.1-3.2 and appendix C; official
``create_datasets.py``).

R1 (retrieval): the teacher prompt has the gold passage at the anchor ("sink") position with the
distractors in file order; a question whose greedy teacher answer is correct gives ``K`` rows with
the gold passage at ``K`` distinct other positions and ``anchor_copies`` rows at the anchor, the
distractors re-shuffled in every row. R2 (reasoning): two gold passages, the teacher's chain of
thought with both at the last two positions, ``K`` rows at other ordered position pairs.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from ragfix.backends.base import Backend
from ragfix.distill.settings import DistillSettings
from ragfix.errors import ConfigError, DataError
from ragfix.metrics import best_subspan_em, normalize_answer
from ragfix.prompts import TaskPrompt
from ragfix.tasks import render_document, score_answer, task_prompt
from ragfix.types import Passage, QASample

#: the paper's R2 instruction (appendix C)
R2_INSTRUCTION = (
    "Let's first identify the relevant information from the long context and list it. Then, "
    "carry out step-by-step reasoning based on that information, and finally, provide the answer. "
    "The final answer must end with \u201cThe answer is:\u201d."
)
_ANSWER_IS = re.compile(r"the answer is[:\uff1a]?\s*(.*)", re.IGNORECASE)
#: teacher prompts answered per ``Backend.generate`` call
TEACHER_BATCH = 8
#: a quotation of the prompt's passage labels ("Document [3](Title: ...)") in a QA answer
_PASSAGE_LABEL = re.compile(r"Document\s*\[\d+\]|\(Title:")


class TeacherReport(BaseModel):
    """What happened to the teacher's answers: questions tried, kept, and why the others were
    dropped (``wrong``: not correct; ``empty``; and, for QA answers and R2 final answers,
    ``quotes_passage``: quotes a passage label such as ``Document [3](Title: ...)``, which passes
    best_subspan_em but teaches the student to recite the context; ``too_long``: more than
    ``max_answer_words`` words per hop)."""

    tried: int = 0
    kept: int = 0
    wrong: int = 0
    empty: int = 0
    quotes_passage: int = 0
    too_long: int = 0


class MultiHopSample(BaseModel):
    """A question that needs several gold passages (R2).

    Attributes:
        id: stable id. question: the question text.
        answers: one list of accepted answers per hop; correct means every hop's answer appears.
        golds: the gold passages (one per hop). distractors: the other passages, fixed order.
    """

    id: str
    question: str
    answers: list[list[str]]
    golds: list[Passage]
    distractors: list[Passage]
    source: str = ""


class DistillRow(BaseModel):
    """One training row: where the gold passage(s) go and in which order the distractors come.

    Attributes:
        sample_id: the question. positions: gold position(s) in the student prompt (0-based).
        order: permutation of the sample's distractor indices for the student prompt.
        anchor: whether this is an anchoring row (R1 gold at the anchor position).
        answer: the teacher's answer text (R1: ``R_adv``; R2: the chain of thought).
    """

    sample_id: str
    positions: list[int]
    order: list[int]
    anchor: bool = False
    answer: str


# ---------------------------------------------------------------------------------- passages
def truncate_passage(p: Passage, max_words: int | None, answers: Sequence[str] = ()) -> Passage:
    """``p`` cut to ``max_words`` words; for a gold passage the window keeps the first occurrence
    of an answer (centred on it when possible), so truncation never removes the evidence."""
    words = p.text.split()
    if max_words is None or len(words) <= max_words:
        return p
    start = 0
    low = p.text.lower()
    for a in answers:
        at = low.find(a.lower())
        if at >= 0:
            start = max(0, min(len(p.text[:at].split()) - max_words // 2, len(words) - max_words))
            break
    return p.model_copy(update={"text": " ".join(words[start : start + max_words])})


def shorten_sample(sample: QASample, max_words: int | None) -> QASample:
    """``sample`` with every passage truncated to ``max_words`` words (KV samples unchanged)."""
    if max_words is None or sample.task == "kv":
        return sample
    return sample.model_copy(
        update={
            "gold": truncate_passage(sample.gold, max_words, sample.answers),
            "distractors": [truncate_passage(d, max_words) for d in sample.distractors],
        }
    )


def resolve_anchor(anchor_position: int, num_docs: int) -> int:
    """The 0-based anchor position (``-1`` = last).

    Raises:
        ConfigError: outside ``-num_docs .. num_docs - 1``.
    """
    if not -num_docs <= anchor_position < num_docs:
        raise ConfigError(
            f"anchor_position {anchor_position} out of range for {num_docs} documents"
        )
    return anchor_position % num_docs


def arrange(sample: QASample | MultiHopSample, positions: Sequence[int], order=None):
    """The context of ``sample`` with its distractors in ``order`` (default: file order) and its
    gold passage(s) at ``positions`` (0-based positions in the final list, ascending or not).

    Raises:
        ValueError: wrong number of positions, repeated or out-of-range positions, or ``order``
            is not a permutation of the distractor indices (a bug of the caller).
    """
    golds = [sample.gold] if isinstance(sample, QASample) else list(sample.golds)
    n = len(sample.distractors) + len(golds)
    if len(positions) != len(golds) or len(set(positions)) != len(golds):
        raise ValueError(f"need {len(golds)} distinct gold positions, got {list(positions)}")
    if any(not 0 <= p < n for p in positions):
        raise ValueError(f"gold positions {list(positions)} out of range 0..{n - 1}")
    order = list(range(len(sample.distractors))) if order is None else list(order)
    if sorted(order) != list(range(len(sample.distractors))):
        raise ValueError("order must be a permutation of the distractor indices")
    rest = iter(sample.distractors[i] for i in order)
    at = dict(zip(positions, golds, strict=True))
    return [at[i] if i in at else next(rest) for i in range(n)]


# ---------------------------------------------------------------------------------- R2
def r2_prompt(sample: MultiHopSample, passages: list[Passage], max_new_tokens: int) -> TaskPrompt:
    """The R2 chain-of-thought prompt (paper's instruction, documents numbered from 1)."""
    docs = "\n".join(render_document(i + 1, p) for i, p in enumerate(passages))
    return TaskPrompt(
        user=f"{R2_INSTRUCTION}\n\n{docs}\n\nQuestion: {sample.question}",
        max_new_tokens=max_new_tokens,
        stop_at_newline=False,
    )


def extract_final_answer(text: str) -> str:
    """The text after the last "The answer is:" (the R2 evaluation rule), or "" if absent."""
    found = _ANSWER_IS.findall(text)
    return found[-1].strip() if found else ""


def r2_correct(sample: MultiHopSample, text: str) -> bool:
    """Every hop's answer (best_subspan_em) is in the extracted final answer."""
    final = extract_final_answer(text)
    return bool(final) and all(best_subspan_em(final, hop) for hop in sample.answers)


def _pair(a: QASample, b: QASample, num_docs: int) -> MultiHopSample:
    """The two-passage question of ``a`` and ``b`` (see :func:`compose_two_passage`)."""
    pool = []
    for d in (x for pair in zip(a.distractors, b.distractors, strict=False) for x in pair):
        if d.title not in (a.gold.title, b.gold.title) and d not in pool:
            pool.append(d)
    if len(pool) < num_docs - 2:
        raise DataError(
            a.source or a.id,
            None,
            "ctxs",
            f"{a.id}+{b.id}: only {len(pool)} distractors for {num_docs} documents",
        )
    q1, q2 = a.question.rstrip(" ?"), b.question.rstrip(" ?")
    return MultiHopSample(
        id=f"{a.id}+{b.id}",
        question=f"{q1}? And {q2}?",
        answers=[a.answers, b.answers],
        golds=[a.gold, b.gold],
        distractors=pool[: num_docs - 2],
        source=f"{a.source} + {b.source}",
    )


def compose_two_passage(
    samples: Sequence[QASample], num_docs: int, excluded: Sequence = ()
) -> list[MultiHopSample]:
    """Two-passage questions built from consecutive pairs of NQ samples: "Q1? And Q2?", whose
    answer must contain both answers; the two gold passages plus distractors from both samples.

    This is a stand-in for MuSiQue/HotpotQA (not installable offline): both passages are needed,
    but the second hop does not depend on the first one's answer.

    Args:
        samples: QA samples, paired in order (0+1, 2+3, ...).
        num_docs: passages per composed question.
        excluded: evaluation samples; a pair with a member among them (same id or question, see
            :func:`exclude_questions`) is dropped after pairing.

    Raises:
        ConfigError: ``num_docs`` < 3.
        DataError: a KV sample, or too few distractors in a pair.
    """
    if num_docs < 3:
        raise ConfigError("two-passage questions need num_docs >= 3")
    for s in samples:
        if s.task != "qa":
            raise DataError(s.source or s.id, None, "task", "R2 composes QA samples, not KV")
    pairs = [_pair(a, b, num_docs) for a, b in zip(samples[0::2], samples[1::2], strict=False)]
    if not excluded:
        return pairs
    keep = {s.id for s in exclude_questions(samples, excluded)}
    return [m for m in pairs if all(p in keep for p in m.id.split("+"))]


# ---------------------------------------------------------------------------------- rows
def r1_rows(
    sample: QASample,
    answer: str,
    positions_per_question: int,
    anchor: int,
    anchor_copies: int,
    rng: random.Random,
) -> list[DistillRow]:
    """The R1 rows of one question: ``K`` distinct trivial positions (never the anchor) and
    ``anchor_copies`` rows at the anchor, each with a fresh shuffle of the same distractors."""
    trivial = [p for p in range(sample.num_docs) if p != anchor]
    chosen = sorted(rng.sample(trivial, min(positions_per_question, len(trivial))))
    rows = []
    for pos, is_anchor in [(p, False) for p in chosen] + [(anchor, True)] * anchor_copies:
        order = list(range(len(sample.distractors)))
        rng.shuffle(order)
        rows.append(
            DistillRow(
                sample_id=sample.id, positions=[pos], order=order, anchor=is_anchor, answer=answer
            )
        )
    return rows


def r2_rows(
    sample: MultiHopSample, answer: str, positions_per_question: int, rng: random.Random
) -> list[DistillRow]:
    """The R2 rows of one question: ``K`` distinct ordered position pairs other than the teacher's
    (the last two positions), each with a fresh shuffle of the distractors."""
    n = len(sample.distractors) + len(sample.golds)
    teacher = (n - 2, n - 1)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j and (i, j) != teacher]
    rows = []
    for pair in rng.sample(pairs, min(positions_per_question, len(pairs))):
        order = list(range(len(sample.distractors)))
        rng.shuffle(order)
        rows.append(
            DistillRow(sample_id=sample.id, positions=list(pair), order=order, answer=answer)
        )
    return rows


def teacher_prompt(sample, settings: DistillSettings) -> TaskPrompt:
    """The teacher prompt: distractors in file order, gold at the anchor (R1) or the two golds at
    the last two positions (R2)."""
    if isinstance(sample, MultiHopSample):
        n = len(sample.distractors) + len(sample.golds)
        return r2_prompt(sample, arrange(sample, [n - 2, n - 1]), settings.r2_max_new_tokens)
    pos = resolve_anchor(settings.anchor_position, sample.num_docs)
    return task_prompt(sample, arrange(sample, [pos]))


def student_prompt(sample, row: DistillRow, settings: DistillSettings) -> TaskPrompt:
    """The prompt of one training row."""
    passages = arrange(sample, row.positions, row.order)
    if isinstance(sample, MultiHopSample):
        return r2_prompt(sample, passages, settings.r2_max_new_tokens)
    return task_prompt(sample, passages)


def teacher_answer_text(sample, text: str) -> str:
    """What the student is trained on: R1 QA keeps the first line (as the metric reads it)."""
    if isinstance(sample, QASample) and sample.task == "qa":
        return text.strip().split("\n")[0].strip()
    return text.strip()


def answer_problem(sample, answer: str, settings: DistillSettings) -> str | None:
    """Why a correct teacher answer (:func:`teacher_answer_text`) is not trained on: ``"empty"``,
    ``"quotes_passage"`` or ``"too_long"`` (see :class:`TeacherReport`); ``None`` when it is kept.

    R1 QA checks the answer; R2 checks the final answer of the chain of thought (the text after
    "The answer is:", :func:`extract_final_answer`; the chain itself may list the passages, as
    the paper's instruction asks), with ``max_answer_words`` per hop. A quoted passage holds the
    gold strings, so best_subspan_em accepts it; training on it teaches the student to recite
    the context. KV values are only checked for emptiness."""
    if not answer:
        return "empty"
    if isinstance(sample, MultiHopSample):
        answer, hops = extract_final_answer(answer), len(sample.answers)
    elif isinstance(sample, QASample) and sample.task == "qa":
        hops = 1
    else:
        return None
    if _PASSAGE_LABEL.search(answer):
        return "quotes_passage"
    limit = settings.max_answer_words
    if limit is not None and len(answer.split()) > limit * hops:
        return "too_long"
    return None


def sample_rows(
    sample, answer: str, settings: DistillSettings, rng: random.Random
) -> list[DistillRow]:
    """The rows of one kept question: :func:`r2_rows` for a :class:`MultiHopSample`, else
    :func:`r1_rows` around the anchor."""
    k = settings.positions_per_question
    if isinstance(sample, MultiHopSample):
        return r2_rows(sample, answer, k, rng)
    anchor = resolve_anchor(settings.anchor_position, sample.num_docs)
    return r1_rows(sample, answer, k, anchor, settings.anchor_copies, rng)


def build_rows(
    backend: Backend,
    samples: Sequence,
    settings: DistillSettings,
    progress: Callable[[int, int, int], None] | None = None,
    generated: dict[str, str] | None = None,
    on_generated: Callable[[dict[str, str]], None] | None = None,
):
    """Teacher answers at the advantaged position, filtered for correctness, and the rows.

    Args:
        backend: the initial model (the teacher), used only through ``Backend.generate``.
        samples: QA/KV samples (R1) or :class:`MultiHopSample` (R2), in the order to try them.
        progress: optional callable ``(done, total, kept)`` called after each batch.
        generated: teacher generations of an interrupted run, by sample id (greedy, so the same
            text); their samples are not generated again.
        on_generated: called with each batch's new generations (by sample id), to keep them.

    Returns:
        ``(kept_samples, rows, report)``: the first ``settings.questions`` samples whose teacher
        answer is correct and passes :func:`answer_problem`, their rows, and the
        :class:`TeacherReport` (the samples tried, each dropped one counted once, by its first
        reason).
    """
    rng = random.Random(settings.seed)
    kept, rows, report = [], [], TeacherReport()
    texts = dict(generated or {})
    for start in range(0, len(samples), TEACHER_BATCH):
        chunk = samples[start : start + TEACHER_BATCH]
        todo = [s for s in chunk if s.id not in texts]
        if todo:
            prompts = [teacher_prompt(s, settings) for s in todo]
            gens = backend.generate(prompts, batch_size=TEACHER_BATCH)
            new = {s.id: g.text for s, g in zip(todo, gens, strict=True)}
            texts.update(new)
            if on_generated is not None:
                on_generated(new)
        for s in chunk:
            if len(kept) >= settings.questions:
                break  # answered in the last batch but not needed
            report.tried += 1
            text = texts[s.id]
            ok = r2_correct(s, text) if isinstance(s, MultiHopSample) else score_answer(s, text)
            answer = teacher_answer_text(s, text)
            problem = "wrong" if not ok else answer_problem(s, answer, settings)
            if problem is None:
                kept.append(s)
                rows += sample_rows(s, answer, settings, rng)
            else:
                setattr(report, problem, getattr(report, problem) + 1)
        if progress is not None:
            progress(report.tried, len(samples), len(kept))
        if len(kept) >= settings.questions:
            break
    report.kept = len(kept)
    return kept, rows, report


def exclude_questions(samples: Sequence, excluded: Sequence) -> list:
    """``samples`` without any whose id or normalised question is among ``excluded``'s.

    Used to keep training questions disjoint from evaluation questions."""
    ids = {s.id for s in excluded}
    questions = {normalize_answer(s.question) for s in excluded}
    return [s for s in samples if s.id not in ids and normalize_answer(s.question) not in questions]


__all__ = [
    "R2_INSTRUCTION",
    "DistillRow",
    "MultiHopSample",
    "TeacherReport",
    "answer_problem",
    "arrange",
    "build_rows",
    "compose_two_passage",
    "exclude_questions",
    "extract_final_answer",
    "r1_rows",
    "r2_correct",
    "r2_prompt",
    "r2_rows",
    "resolve_anchor",
    "sample_rows",
    "shorten_sample",
    "student_prompt",
    "teacher_answer_text",
    "teacher_prompt",
    "truncate_passage",
]
