"""Readers for pairwise judgment data: pairs to judge, and verdicts other judges gave.

Pairs (each becomes a :class:`ragfix.types.JudgePair`, ``answer_a`` = the first answer of the
file, ``label`` as an answer verdict ``"A"`` / ``"B"`` / ``"tie"``):

* ``llmbar``: LLMBar (Zeng et al., ICLR 2024) ``input``, ``output_1``, ``output_2``, ``label``
  (1 or 2), plus ``subset`` and ``idx``;
* ``pandalm``: the PandaLM test set (Wang et al. 2023) ``instruction``, ``input``,
  ``response1``, ``response2``, ``annotator1..3`` (0 = tie, 1, 2); the label is the majority of
  the three annotators (none when all three differ);
* ``mtbench``: MT-bench model answers (FastChat ``model_answer`` format: ``question_id``,
  ``model_id``, ``choices[0].turns``) with the questions file (``question_id``, ``turns``) and,
  where present, GPT-4 reference answers; one pair per question for two chosen models, first turn;
  no labels;
* ``simple``: our own JSON Lines: ``question``, ``answer_a``, ``answer_b``, optional ``label``
  (``A``, ``B``, ``tie``; ``C``, ``1``, ``2``, ``0`` accepted), optional ``reference`` and ``id``;
* ``kv``: pairs made from Lost-in-the-Middle KV-retrieval records (``key``, ``value``,
  ``ordered_kv_records``), a judge task whose ground truth is in the prompt
  (:func:`load_kv_pairs`).

Verdicts: ``swap_judgments`` (LLMBar's evaluator outputs: ``evaluator``, ``winner_original_order``
and ``winner_swapped_order``, both in the original numbering).

Bad input: a missing or mistyped field stops with ``file:line: field: message``
(:class:`~ragfix.errors.DataError`); an unknown label value likewise. Empty and
identical answers are kept and flagged on the pair (:attr:`JudgePair.flags`); missing labels are
None (agreement with humans is then not reported).

Each pair is judged and counted once: two pairs of a file with the same ``pair_id`` keep their
own ids (the later one gets ``#2``, ... with a warning, :class:`~ragfix.connectors.jsonl.
UniqueIds`); two MT-bench answers of one model to one question, a question id given twice, and
one evaluator's verdicts on one item given twice are refused (they cannot both be right).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from ragfix.connectors.jsonl import (
    SkipCounter,
    UniqueIds,
    read_jsonl,
    refuse_duplicate,
    require,
    skip_or_raise,
)
from ragfix.errors import ConfigError, DataError
from ragfix.types import JudgePair, Passage, pair_id

FORMATS = ("llmbar", "pandalm", "mtbench", "simple", "kv", "swap_judgments")

#: the fields each format wants (named in the error for a file that is not JSON Lines)
FIELDS = {
    "llmbar": "input, output_1, output_2, label (1 or 2)",
    "pandalm": "instruction, input, response1, response2, annotator1..3",
    "mtbench": "question_id, model_id, choices[turns]",
    "mtbench_questions": "question_id, turns",
    "simple": "question, answer_a, answer_b, optional label (A, B, tie)",
    "kv": "key, value, ordered_kv_records",
    "swap_judgments": "evaluator, winner_original_order, winner_swapped_order",
}

_LABELS = {
    "a": "A",
    "b": "B",
    "tie": "tie",
    "c": "tie",
    "1": "A",
    "2": "B",
    "0": "tie",
}


def detect_format(path: str | Path) -> str:
    """The format of a pairwise file (see the module docstring) from its first record's fields.

    Raises:
        DataError: no records, or the first record matches no format.
    """
    fields = f"{FIELDS['simple']} (or LLMBar: {FIELDS['llmbar']})"
    for line, rec in read_jsonl(path, skip_invalid=True, fields=fields):
        if "winner_original_order" in rec:
            return "swap_judgments"
        if "output_1" in rec or "output_2" in rec:
            return "llmbar"
        if "response1" in rec or "response2" in rec:
            return "pandalm"
        if "model_id" in rec and "choices" in rec:
            return "mtbench"
        if "answer_a" in rec or "answer_b" in rec:
            return "simple"
        if "ordered_kv_records" in rec:
            return "kv"
        raise DataError(
            path,
            line,
            None,
            "not a pairwise record: expected question/answer_a/answer_b (or LLMBar, PandaLM, "
            "MT-bench answers, LLMBar swap judgments)",
        )
    raise DataError(path, None, None, "no records")


def _answer(rec: dict, field: str, path, line: int) -> str:
    """An answer text: must be present; may be empty (flagged later). JSON scalars (PandaLM stores
    a few one-word answers as booleans) are kept as their text."""
    if field not in rec:
        raise DataError(path, line, field, "missing")
    val = rec[field]
    if isinstance(val, bool | int | float):
        return str(val)
    if not isinstance(val, str):
        raise DataError(path, line, field, f"expected str, got {type(val).__name__}")
    return val


def parse_label(value, path, line: int, field: str = "label") -> str | None:
    """A human label as an answer verdict; None when absent.

    Raises:
        DataError: a value that is none of ``A``, ``B``, ``tie``, ``C``, ``1``, ``2``, ``0``.
    """
    if value is None or value == "":
        return None
    key = str(value).strip().lower()
    if isinstance(value, bool) or key not in _LABELS:
        raise DataError(path, line, field, f"unknown label {value!r}; expected A, B or tie")
    return _LABELS[key]


def majority_label(votes: list[int], path, line: int) -> str | None:
    """The label at least two of three PandaLM annotators gave (0 = tie, 1, 2); None if all three
    differ.

    Raises:
        DataError: a vote other than 0, 1, 2.
    """
    for i, v in enumerate(votes, 1):
        if isinstance(v, bool) or v not in (0, 1, 2):
            raise DataError(path, line, f"annotator{i}", f"unknown vote {v!r}; expected 0, 1 or 2")
    top, count = Counter(votes).most_common(1)[0]
    return {0: "tie", 1: "A", 2: "B"}[top] if count >= 2 else None


def _read(path, limit, skip_invalid, skipped, parse, fmt: str) -> list[JudgePair]:
    """The pairs ``parse(rec, line)`` makes of a file's records, each with its own ``pair_id``.

    Warns:
        UserWarning: pairs with the same id were given distinct ids (:class:`UniqueIds`).
    """
    out: list[JudgePair] = []
    unique = UniqueIds(path, "pair", "pair id")
    for line, rec in read_jsonl(path, skip_invalid, skipped, FIELDS[fmt]):
        if limit is not None and len(out) >= limit:
            break
        try:
            pair = parse(rec, line)
        except DataError as e:
            skip_or_raise(e, skip_invalid, skipped)
            continue
        out.append(pair.model_copy(update={"pair_id": unique(pair.pair_id, line)}))
    unique.warn()
    return out


def load_llmbar(
    path: str | Path,
    limit: int | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
) -> list[JudgePair]:
    """LLMBar pairs; ``pair_id`` = ``llmbar:<subset>:<idx>``.

    Raises:
        DataError: a missing/mistyped field or a label other than 1/2 (unless ``skip_invalid``).
    """

    def parse(rec: dict, line: int) -> JudgePair:
        question = require(rec, "input", str, path, line)
        label = rec.get("label")
        if label is not None and (isinstance(label, bool) or label not in (1, 2)):
            raise DataError(path, line, "label", f"unknown label {label!r}; expected 1 or 2")
        key = f"{rec.get('subset', '')}:{rec.get('idx', line)}"
        return JudgePair(
            pair_id=f"llmbar:{key}",
            question=question,
            answer_a=_answer(rec, "output_1", path, line),
            answer_b=_answer(rec, "output_2", path, line),
            label=None if label is None else ("A" if label == 1 else "B"),
            source=f"{path}:{line}",
        )

    return _read(path, limit, skip_invalid, skipped, parse, "llmbar")


def load_pandalm(
    path: str | Path,
    limit: int | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
) -> list[JudgePair]:
    """PandaLM test-set pairs; the question is ``instruction`` plus ``input`` (when not empty);
    the label is the annotators' majority; ``pair_id`` = ``pandalm:<idx>``.

    Raises:
        DataError: a missing/mistyped field or an unknown vote (unless ``skip_invalid``).
    """

    def parse(rec: dict, line: int) -> JudgePair:
        instruction = require(rec, "instruction", str, path, line)
        extra = rec.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(path, line, "input", f"expected str, got {type(extra).__name__}")
        votes = [rec.get(f"annotator{i}") for i in (1, 2, 3)]
        label = None if all(v is None for v in votes) else majority_label(votes, path, line)
        return JudgePair(
            pair_id=f"pandalm:{rec.get('idx', line)}",
            question=f"{instruction}\n\n{extra}" if extra.strip() else instruction,
            answer_a=_answer(rec, "response1", path, line),
            answer_b=_answer(rec, "response2", path, line),
            label=label,
            source=f"{path}:{line}",
        )

    return _read(path, limit, skip_invalid, skipped, parse, "pandalm")


def load_simple(
    path: str | Path,
    limit: int | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
) -> list[JudgePair]:
    """Our own pairs: ``question``, ``answer_a``, ``answer_b``, optional ``label``, ``reference``
    and ``id`` (else the id is a hash of the texts).

    Raises:
        DataError: a missing/mistyped field or an unknown label (unless ``skip_invalid``).
    """

    def parse(rec: dict, line: int) -> JudgePair:
        question = require(rec, "question", str, path, line)
        a = _answer(rec, "answer_a", path, line)
        b = _answer(rec, "answer_b", path, line)
        ref = rec.get("reference")
        if ref is not None and not isinstance(ref, str):
            raise DataError(path, line, "reference", f"expected str, got {type(ref).__name__}")
        return JudgePair(
            pair_id=str(rec["id"]) if rec.get("id") is not None else pair_id(question, a, b),
            question=question,
            answer_a=a,
            answer_b=b,
            reference=ref or None,
            label=parse_label(rec.get("label"), path, line),  # type: ignore[arg-type]
            source=f"{path}:{line}",
        )

    return _read(path, limit, skip_invalid, skipped, parse, "simple")


#: KV pairs per judge question (the gold pair and this many minus one distractor pairs)
KV_PAIR_CONTEXT = 8
#: seed of the KV pairs' random choices (with the record's line: each pair on its own)
KV_PAIR_SEED = 0
#: where a KV pair's wrong answer comes from (see :func:`load_kv_pairs`)
KV_WRONG = ("context", "unsupported")


def load_kv_pairs(
    path: str | Path,
    limit: int | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
    wrong: str = "context",
) -> list[JudgePair]:
    """Judge pairs from KV-retrieval records: a task whose answer is in the prompt, so a small
    judge can do it and its slot or letter preference shows against a known truth.

    Per record: the question is the KV task's user turn (:data:`ragfix.tasks.KV`: the JSON object
    of the gold pair and the first ``KV_PAIR_CONTEXT - 1`` other pairs in file order, as
    :func:`~ragfix.connectors.litm.load_kv` takes them, shuffled; the key asked), one answer is
    the key's value, the other the value of a distractor pair of the same object; which
    distractor, the order of the object and whether the right value is ``answer_a`` (label
    ``A``) or ``answer_b`` (``B``) are drawn from ``random.Random(f"{KV_PAIR_SEED}:{line}")``,
    so the pairs are the same on every read and a record's pair does not depend on the others.
    The label is the ground truth (the value stored under the key), what a human annotator
    would give. ``pair_id`` = ``kv:<line>:<key>``.

    ``wrong`` says where the wrong answer comes from (:data:`KV_WRONG`): ``context`` (the value
    of a distractor pair of the object: the judge must bind the key to its value) or
    ``unsupported`` (the value of a pair of the record that is not in the object, drawn from
    ``random.Random(f"{KV_PAIR_SEED}:{line}:unsupported")``: no given passage supports it, so
    the judge must check which answer the passages contain, a RAG faithfulness judgment). The
    object, the key and the side of the right value are the same either way.

    Raises:
        ConfigError: an unknown ``wrong``.
        DataError: a malformed record (:func:`~ragfix.connectors.litm.load_kv`'s checks) or
            fewer than ``KV_PAIR_CONTEXT`` pairs (``KV_PAIR_CONTEXT + 1`` for ``unsupported``;
            unless ``skip_invalid``).
    """
    from ragfix.connectors.litm import _parse_kv
    from ragfix.tasks import KV

    if wrong not in KV_WRONG:
        raise ConfigError(
            f"unknown KV wrong answer {wrong!r}; choose one of: {', '.join(KV_WRONG)}"
        )
    needed = KV_PAIR_CONTEXT + (wrong == "unsupported")

    def parse(rec: dict, line: int) -> JudgePair:
        key, value, others = _parse_kv(rec, path, line)
        if len(others) < needed - 1:
            raise DataError(
                path,
                line,
                "ordered_kv_records",
                f"a KV judge pair needs {needed} pairs, got {len(others) + 1}",
            )
        rng = random.Random(f"{KV_PAIR_SEED}:{line}")
        members = [(key, value), *(tuple(p) for p in others[: KV_PAIR_CONTEXT - 1])]
        rng.shuffle(members)
        other = rng.choice([v for k, v in members if k != key])
        if wrong == "unsupported":  # its own generator: the label below is drawn as before
            shown = {v for _, v in members}
            unshown = [v for _, v in others[KV_PAIR_CONTEXT - 1 :] if v not in shown]
            other = random.Random(f"{KV_PAIR_SEED}:{line}:unsupported").choice(unshown)
        label = rng.choice(("A", "B"))
        a, b = (value, other) if label == "A" else (other, value)
        context = [Passage(title=k, text=v) for k, v in members]
        return JudgePair(
            pair_id=f"kv:{line}:{key}",
            question=KV.user_turn(key, context),
            answer_a=a,
            answer_b=b,
            label=label,
            source=f"{path}:{line}",
        )

    return _read(path, limit, skip_invalid, skipped, parse, "kv")


def load_mtbench(
    path: str | Path,
    questions: str | Path,
    models: tuple[str, str],
    references: str | Path | None = None,
    limit: int | None = None,
) -> list[JudgePair]:
    """MT-bench pairs: for every question both models answered, first turn, ``answer_a`` = the
    first model's; with ``references`` (FastChat ``reference_answer/gpt-4.jsonl``) the reference
    answer is attached where one exists (math, reasoning, coding). ``pair_id`` =
    ``mtbench:<question_id>:<model_1>:<model_2>``. A turn stored as the string ``"None"`` (a
    missing answer in the source sheet) becomes an empty answer, flagged.

    Raises:
        DataError: a missing field, an unknown model (the message lists the known ones), an
            answer whose question is not in ``questions``, or a question id (in any of the
            files) or a model's answer to a question given twice (both lines named).
    """
    qtext: dict[int, str] = {}
    seen: dict = {}
    for line, rec in read_jsonl(questions, fields=FIELDS["mtbench_questions"]):
        turns = require(rec, "turns", list, questions, line)
        qid = require(rec, "question_id", int, questions, line)
        refuse_duplicate(seen, qid, questions, line, "question_id", f"question {qid}")
        qtext[qid] = str(turns[0])
    refs: dict[int, str] = {}
    if references is not None:
        seen = {}
        for line, rec in read_jsonl(references, fields=FIELDS["mtbench"]):
            turns = require(rec, "choices", list, references, line)[0].get("turns") or [""]
            qid = require(rec, "question_id", int, references, line)
            refuse_duplicate(seen, qid, references, line, "question_id", f"reference {qid}")
            refs[qid] = str(turns[0])
    answers: dict[str, dict[int, tuple[str, int]]] = {}
    seen = {}
    for line, rec in read_jsonl(path, fields=FIELDS["mtbench"]):
        model = require(rec, "model_id", str, path, line)
        qid = require(rec, "question_id", int, path, line)
        refuse_duplicate(
            seen, (model, qid), path, line, "question_id", f"answer of {model} to {qid}"
        )
        choices = require(rec, "choices", list, path, line)
        turns = choices[0].get("turns") if isinstance(choices[0], dict) else None
        if not isinstance(turns, list) or not turns:
            raise DataError(path, line, "choices[0].turns", "missing or empty")
        if qid not in qtext:
            raise DataError(path, line, "question_id", f"{qid} is not in {questions}")
        text = turns[0] if isinstance(turns[0], str) and turns[0] != "None" else ""
        answers.setdefault(model, {})[qid] = (text, line)
    for m in models:
        if m not in answers:
            raise DataError(
                path, None, "model_id", f"no answers by {m!r}; known: {', '.join(sorted(answers))}"
            )
    m1, m2 = models
    out = []
    for qid in sorted(set(answers[m1]) & set(answers[m2])):
        if limit is not None and len(out) >= limit:
            break
        (a, line), (b, _) = answers[m1][qid], answers[m2][qid]
        out.append(
            JudgePair(
                pair_id=f"mtbench:{qid}:{m1}:{m2}",
                question=qtext[qid],
                answer_a=a,
                answer_b=b,
                reference=refs.get(qid),
                source=f"{path}:{line}",
            )
        )
    return out


def load_swap_judgments(path: str | Path, limit: int | None = None) -> dict[str, list[dict]]:
    """LLMBar's swap judgments of other judges, per evaluator, as slot verdicts.

    A record holds ``evaluator``, ``label`` (1/2), ``winner_original_order`` and
    ``winner_swapped_order``, both in the original numbering (``"1"`` = output_1), or null when
    the evaluator's output could not be read. In the swapped run output_1 sat in the second slot,
    so its winner ``"1"`` is slot verdict ``"B"``.

    Args:
        limit: keep the first ``limit`` items of each evaluator.

    Returns:
        ``{evaluator: [{"item", "original", "swapped", "label"}, ...]}``, slot verdicts
        ``"A"`` / ``"B"`` / ``"invalid"``, label as an answer verdict.

    Raises:
        DataError: a missing field, a winner/label other than 1/2/null, or one evaluator's
            verdicts on one item given twice (both lines named).
    """
    out: dict[str, list[dict]] = {}
    seen: dict = {}
    for line, rec in read_jsonl(path, fields=FIELDS["swap_judgments"]):
        ev = require(rec, "evaluator", str, path, line)
        item = f"{rec.get('subset', '')}:{rec.get('idx', line)}"
        refuse_duplicate(seen, (ev, item), path, line, "idx", f"verdict of {ev} on {item}")
        rows = out.setdefault(ev, [])
        if limit is not None and len(rows) >= limit:
            continue
        slots = []
        for field, first in (("winner_original_order", "A"), ("winner_swapped_order", "B")):
            if field not in rec:
                raise DataError(path, line, field, "missing")
            w = rec[field]
            if w is None:
                slots.append("invalid")
            elif str(w) in ("1", "2"):
                second = "B" if first == "A" else "A"
                slots.append(first if str(w) == "1" else second)
            else:
                raise DataError(path, line, field, f"unknown winner {w!r}; expected 1, 2 or null")
        rows.append(
            {
                "item": item,
                "original": slots[0],
                "swapped": slots[1],
                "label": parse_label(rec.get("label"), path, line),
            }
        )
    return out


def load_pairs(
    path: str | Path,
    limit: int | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
    mtbench_models: tuple[str, str] = ("gpt-4", "gpt-3.5-turbo"),
    mtbench_questions: str | Path | None = None,
    kv_wrong: str = "context",
) -> list[JudgePair]:
    """Pairs from any pair format (detected with :func:`detect_format`). For MT-bench answers the
    questions file defaults to ``mtbench_question.jsonl`` next to ``path``, and
    ``mtbench_reference_answer_gpt-4.jsonl`` there is used when present. ``kv_wrong`` is
    :func:`load_kv_pairs`'s ``wrong``.

    Raises:
        ConfigError: ``kv_wrong`` other than ``context`` for a file that is not KV records, or
            unknown.
        DataError: bad records, a judgments file (it holds verdicts, not pairs), or a missing
            MT-bench questions file.
    """
    fmt = detect_format(path)
    if kv_wrong != "context" and fmt != "kv":
        raise ConfigError(f"{path}: the KV wrong answer applies to KV-retrieval records, not {fmt}")
    if fmt == "llmbar":
        return load_llmbar(path, limit, skip_invalid, skipped)
    if fmt == "pandalm":
        return load_pandalm(path, limit, skip_invalid, skipped)
    if fmt == "simple":
        return load_simple(path, limit, skip_invalid, skipped)
    if fmt == "kv":
        return load_kv_pairs(path, limit, skip_invalid, skipped, kv_wrong)
    if fmt == "mtbench":
        folder = Path(path).parent
        questions = Path(mtbench_questions or folder / "mtbench_question.jsonl")
        if not questions.exists():
            raise DataError(questions, None, None, "MT-bench questions file not found")
        ref = folder / "mtbench_reference_answer_gpt-4.jsonl"
        return load_mtbench(path, questions, mtbench_models, ref if ref.exists() else None, limit)
    raise DataError(path, None, None, "holds verdicts of other judges, not pairs to judge")
