"""Readers for the Lost-in-the-Middle data formats (Liu et al., TACL 2024).

* Multi-document QA: one JSON object a line with ``question``, ``answers`` (list) and ``ctxs``
  (passages with ``title``, ``text``, ``isgold``, ``hasanswer``). The oracle file has only the gold
  passage; the 10/20/30-document files (and our derived BM25-pool files) also carry distractors.
* KV retrieval: ``ordered_kv_records`` (list of ``[key, value]``), ``key``, ``value``.

Both become :class:`~ragfix.types.QASample` objects with a fixed distractor order, so the sweep
can move the gold passage without changing anything else.

Records are validated by type: ``isgold`` must be a JSON boolean (the string ``"false"`` is an
error, not a gold passage), a QA record has exactly one gold passage, every passage a ``title``
and a ``text``; a KV record has at least two ``[key, value]`` pairs of strings with unique keys,
the gold pair among them. Errors name the file, the line and the field. Two records with the same
identity (QA: question and gold passage; KV: key and value) stay two samples with their own ids
(:class:`~ragfix.connectors.jsonl.UniqueIds`, with a warning).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ragfix.connectors.jsonl import (
    SkipCounter,
    UniqueIds,
    json_type,
    no_valid_records,
    read_jsonl,
    require,
    require_bool,
    skip_or_raise,
)
from ragfix.connectors.records import parse_records, select_records
from ragfix.errors import DataError
from ragfix.metrics import normalize_answer
from ragfix.types import Passage, QASample

#: the fields each format wants (named in the error for a file that is not JSON Lines)
QA_FIELDS = "question, answers, ctxs[title, text, isgold]"
KV_FIELDS = "ordered_kv_records, key, value"


def sample_id(*parts: str) -> str:
    """Stable 12-hex id of a sample from its identifying text."""
    return hashlib.sha1("\x1f".join(parts).encode()).hexdigest()[:12]


def detect_format(path: str | Path) -> str:
    """``"kv"`` or ``"qa"`` from the first record's fields.

    Raises:
        DataError: the file is empty or its first record has neither format's fields.
    """
    fields = f"{QA_FIELDS} (QA) or {KV_FIELDS} (KV retrieval)"
    for line, rec in read_jsonl(path, skip_invalid=True, fields=fields):
        if "ordered_kv_records" in rec:
            return "kv"
        if "question" in rec and "ctxs" in rec:
            return "qa"
        raise DataError(
            path,
            line,
            None,
            f"neither a Lost-in-the-Middle QA record ({QA_FIELDS}) "
            f"nor a KV-retrieval record ({KV_FIELDS})",
        )
    raise DataError(path, None, None, "no records")


def _passage(ctx, path, line: int, i: int) -> Passage:
    """One ``ctxs`` entry: ``title`` (a string, may be empty), ``text`` (non-empty), ``isgold``
    (a JSON boolean; absent = false), optional ``id``.

    Raises:
        DataError: a missing or mistyped field (``ctxs[i].field``).
    """
    if not isinstance(ctx, dict):
        raise DataError(path, line, f"ctxs[{i}]", f"expected an object, got {json_type(ctx)}")
    if "title" not in ctx:
        raise DataError(path, line, f"ctxs[{i}].title", "missing")
    if not isinstance(ctx["title"], str):
        raise DataError(
            path, line, f"ctxs[{i}].title", f"expected a string, got {json_type(ctx['title'])}"
        )
    text = ctx.get("text")
    if not isinstance(text, str) or not text.strip():
        raise DataError(path, line, f"ctxs[{i}].text", "missing or empty")
    return Passage(
        title=ctx["title"],
        text=text,
        is_gold=require_bool(ctx.get("isgold"), path, line, f"ctxs[{i}].isgold", default=False),
        id=str(ctx["id"]) if ctx.get("id") is not None else None,
    )


def _contains_answer(p: Passage, answers: list[str]) -> bool:
    text = normalize_answer(p.text)
    return any(normalize_answer(a) and normalize_answer(a) in text for a in answers)


def _parse_qa(rec: dict, path, line: int) -> tuple[str, list[str], Passage, list[Passage], int]:
    """``(question, answers, gold, usable distractors, number of passages)`` of a QA record.

    Raises:
        DataError: a missing or mistyped field, or not exactly one gold passage.
    """
    question = require(rec, "question", str, path, line)
    answers = require(rec, "answers", list, path, line)
    if not all(isinstance(a, str) and a.strip() for a in answers):
        raise DataError(path, line, "answers", "every answer must be a non-empty string")
    ctxs = require(rec, "ctxs", list, path, line)
    passages = [_passage(c, path, line, i) for i, c in enumerate(ctxs)]
    golds = [i for i, p in enumerate(passages) if p.is_gold]
    if not golds:
        raise DataError(path, line, "ctxs", "no passage has isgold = true")
    if len(golds) > 1:
        where = ", ".join(f"ctxs[{i}]" for i in golds)
        raise DataError(
            path,
            line,
            "ctxs",
            f"{len(golds)} passages have isgold = true ({where}); exactly one gold is needed",
        )
    distractors = [p for p in passages if not p.is_gold and not _contains_answer(p, answers)]
    return question, answers, passages[golds[0]], distractors, len(passages)


def _bm25_pool(records, path) -> tuple[list[Passage], object]:
    """Every gold passage of the file as a distractor pool, with a BM25 index over it.

    The index is ``bm25s``'s Lucene BM25 (k1 = 1.5, b = 0.75; the scoring of the pipeline's
    ``llama-index-retrievers-bm25`` retriever) over SQuAD-normalised words, in float64.
    """
    import bm25s

    seen, pool = set(), []
    for _, _, _, gold, _, _ in records:
        key = (gold.title, gold.text)
        if key not in seen:
            seen.add(key)
            pool.append(gold.model_copy(update={"is_gold": False}))
    if len(pool) < 2:
        raise DataError(path, None, "ctxs", "no distractors in the file and no pool to draw from")
    index = bm25s.BM25(method="lucene", dtype="float64")
    index.index(
        [normalize_answer(f"{p.title} {p.text}").split() for p in pool], show_progress=False
    )
    return pool, index


def load_qa(
    path: str | Path,
    num_docs: int,
    limit: int | None = None,
    distractor_pool: str | Path | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
) -> list[QASample]:
    """Read Lost-in-the-Middle QA records as ``num_docs``-document samples.

    Distractors come from the record's own non-gold ``ctxs`` (in file order, i.e. retrieval
    order) when it has enough; otherwise from a pool ranked by BM25 against the question: the
    gold passages of ``distractor_pool``, or, for a gold-only record (the oracle files: one
    passage, the gold), the gold passages of the file's other records. A record that carries
    its own distractors but fewer than ``num_docs - 1`` is refused unless ``distractor_pool`` is
    given (padding it with other questions' passages would silently change the experiment; a KV
    record with too few pairs is refused likewise). Passages that contain a gold answer or share
    the gold passage's title are never used as distractors.

    Args:
        path: ``.jsonl`` or ``.jsonl.gz`` file.
        num_docs: passages per prompt (gold included), >= 1.
        limit: read at most this many valid samples (the first ones).
        distractor_pool: optional second file in the same format.
        skip_invalid: skip (and count in ``skipped``) malformed records, and records with too
            few distractors, instead of failing.

    Raises:
        DataError: malformed record (file, line and field named), a record with fewer passages
            than ``num_docs`` and no ``distractor_pool``, or not enough distractors.

    Warns:
        UserWarning: records with the same question and gold passage were given distinct ids.
    """
    if num_docs < 1:
        raise DataError(path, None, "num_docs", f"must be >= 1, got {num_docs}")
    records = []
    need = num_docs - 1
    for line, rec in read_jsonl(path, skip_invalid, skipped, QA_FIELDS):
        try:
            parsed = _parse_qa(rec, path, line)
            n, own = parsed[4], len(parsed[3])
            if distractor_pool is None and n > 1 and own < need:
                usable = f", {own} usable as distractors" if own < n - 1 else ""
                raise DataError(
                    path,
                    line,
                    "ctxs",
                    f"--num-docs {num_docs} needs {need} distractors but the record has {n} "
                    f"passages{usable}; use --num-docs {own + 1} or less, or give "
                    "--distractor-pool FILE to draw the missing distractors from",
                )
            records.append((line, *parsed))
        except DataError as e:
            skip_or_raise(e, skip_invalid, skipped)
    if not records:
        raise no_valid_records(path, skipped)
    pool = bm25 = None
    if any(len(r[4]) < need for r in records[:limit]):
        pool_records = records
        if distractor_pool is not None:
            pool_records = [
                (ln, *_parse_qa(rec, distractor_pool, ln))
                for ln, rec in read_jsonl(distractor_pool, skip_invalid, skipped, QA_FIELDS)
            ]
        pool, bm25 = _bm25_pool(pool_records, distractor_pool or path)
    samples = []
    unique = UniqueIds(path, "sample", "question and gold passage")
    for line, question, answers, gold, own, _ in records[:limit]:
        distractors = own[:need]
        if len(distractors) < need:
            words = normalize_answer(question).split()
            scores = bm25.get_scores_from_ids(bm25.get_tokens_ids(words))
            used = {(p.title, p.text) for p in distractors}
            for i in sorted(range(len(pool)), key=lambda i: -scores[i]):
                p = pool[i]
                if len(distractors) == need:
                    break
                if (p.title, p.text) in used or p.title == gold.title:
                    continue
                if p.text == gold.text or _contains_answer(p, answers):
                    continue
                distractors.append(p)
                used.add((p.title, p.text))
        if len(distractors) < need:
            err = DataError(
                path,
                line,
                "ctxs",
                f"--num-docs {num_docs} needs {need} distractors, "
                f"only {len(distractors)} available",
            )
            skip_or_raise(err, skip_invalid, skipped)
            continue
        samples.append(
            QASample(
                id=unique(sample_id(question, gold.text), line),
                task="qa",
                question=question,
                answers=answers,
                gold=gold,
                distractors=distractors,
                source=f"{path}:{line}",
            )
        )
    unique.warn()
    return samples


def _parse_kv(rec: dict, path, line: int) -> tuple[str, str, list[list[str]]]:
    """``(key, value, the other pairs in file order)`` of a KV record.

    Raises:
        DataError: a missing or mistyped field, a pair that is not ``[key, value]`` strings,
            fewer than two pairs, a key that occurs twice, or the gold pair missing.
    """
    key = require(rec, "key", str, path, line)
    value = require(rec, "value", str, path, line)
    pairs = require(rec, "ordered_kv_records", list, path, line)
    seen: dict[str, int] = {}
    for i, p in enumerate(pairs):
        field = f"ordered_kv_records[{i}]"
        if not (isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)):
            raise DataError(path, line, field, f"expected a [key, value] pair, got {json_type(p)}")
        if p[0] in seen:
            raise DataError(
                path, line, field, f"duplicate key {p[0]!r} (also ordered_kv_records[{seen[p[0]]}])"
            )
        seen[p[0]] = i
    if len(pairs) < 2:
        raise DataError(
            path,
            line,
            "ordered_kv_records",
            f"need at least 2 [key, value] pairs, got {len(pairs)}",
        )
    if [key, value] not in pairs:
        raise DataError(
            path, line, "ordered_kv_records", "the gold pair [key, value] is not among the pairs"
        )
    return key, value, [p for p in pairs if p != [key, value]]


def load_kv(
    path: str | Path,
    num_pairs: int,
    limit: int | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
) -> list[QASample]:
    """Read KV-retrieval records as ``num_pairs``-pair samples.

    The gold ``[key, value]`` pair is taken out of ``ordered_kv_records``; the distractors are the
    first ``num_pairs - 1`` other pairs, in file order (Lost in the Middle's runner pops the gold
    pair and re-inserts it; truncation to a smaller count follows the PositionalHidden scripts).

    Raises:
        DataError: malformed record (see :func:`_parse_kv`), or too few pairs for ``num_pairs``.

    Warns:
        UserWarning: records with the same key and value were given distinct ids.
    """
    if num_pairs < 1:
        raise DataError(path, None, "num_docs", f"must be >= 1, got {num_pairs}")
    samples = []
    unique = UniqueIds(path, "sample", "key and value")
    for line, rec in read_jsonl(path, skip_invalid, skipped, KV_FIELDS):
        if limit is not None and len(samples) >= limit:
            break
        try:
            key, value, others = _parse_kv(rec, path, line)
            if len(others) < num_pairs - 1:
                raise DataError(
                    path,
                    line,
                    "ordered_kv_records",
                    f"--num-docs {num_pairs} needs {num_pairs - 1} distractor pairs, "
                    f"only {len(others)} available",
                )
        except DataError as e:
            skip_or_raise(e, skip_invalid, skipped)
            continue
        samples.append(
            QASample(
                id=unique(sample_id(key, value), line),
                task="kv",
                question=key,
                answers=[value],
                gold=Passage(title=key, text=value, is_gold=True),
                distractors=[Passage(title=k, text=v) for k, v in others[: num_pairs - 1]],
                source=f"{path}:{line}",
            )
        )
    if not samples:
        raise no_valid_records(path, skipped)
    unique.warn()
    return samples


def load_samples(
    path: str | Path,
    num_docs: int,
    limit: int | None = None,
    distractor_pool: str | Path | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
    records: str | slice | None = None,
    task: str | None = None,
) -> list[QASample]:
    """Read a Lost-in-the-Middle QA or KV file (format detected from the first record): the
    samples of the record range ``records`` (``"START:END"`` or a slice,
    :func:`~ragfix.connectors.records.parse_records`; all records when None), then the first
    ``limit`` of them, each read as ``task`` (:attr:`~ragfix.types.QASample.task`; ``None``:
    ``qa`` or ``kv`` as the format; the caller checks that the task reads this format).

    Raises:
        ConfigError: a malformed record range.
        DataError: a missing file or a malformed record (unless ``skip_invalid``).
    """
    rng = parse_records(records) if isinstance(records, str) else records
    first = None if rng is not None else limit
    if detect_format(path) == "kv":
        samples = load_kv(path, num_docs, first, skip_invalid, skipped)
    else:
        samples = load_qa(path, num_docs, first, distractor_pool, skip_invalid, skipped)
    if task is not None:
        samples = [s.model_copy(update={"task": task}) for s in samples]
    return samples if rng is None else select_records(samples, rng)[:limit]
