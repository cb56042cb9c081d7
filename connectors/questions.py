"""The sources of a pipeline sweep's questions, exactly one per run (:func:`check_question_source`):

* a question file (:func:`~ragfix.connectors.corpus.read_questions`, then
  :func:`~ragfix.connectors.corpus.locate_gold`);
* needles planted in the corpus (:func:`~ragfix.connectors.synthetic.plant_needles`, asked by
  :func:`~ragfix.connectors.corpus.needle_questions`);
* questions an LLM writes about the corpus's chunks
  (:func:`~ragfix.connectors.synthetic.write_questions`), kept in the run folder as a question
  file (:data:`WRITTEN_QUESTIONS`, which the first source reads) beside what the filter dropped
  (:data:`WRITTEN_REPORT`): :func:`write_question_file`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ragfix.connectors.corpus import Corpus, describe_copies
from ragfix.connectors.synthetic import QuestionsFrom, write_questions
from ragfix.errors import ConfigError, DataError
from ragfix.io import atomic_write_json, atomic_write_text

#: the run folder's file of LLM-written questions (``--questions-from``; a question file that
#: ``--questions`` reads) and the count of what its filter dropped
WRITTEN_QUESTIONS = "questions.jsonl"
WRITTEN_REPORT = "questions-filter.json"


def check_question_source(questions, needles, questions_from) -> None:
    """Exactly one source of questions for a pipeline sweep.

    Raises:
        ConfigError: none or several of a question file, needles and a question-writing model.
    """
    flags = ("--questions", "--needles", "--questions-from")
    sources = (questions, needles, questions_from)
    given = [f for f, v in zip(flags, sources, strict=True) if v is not None]
    if len(given) != 1:
        raise ConfigError(
            "ragfix eval-pipeline needs one source of questions: --questions FILE, --needles N "
            f"or --questions-from MODEL (given: {' and '.join(given) or 'none'})"
        )


def write_question_file(writer, corpus: Corpus, settings: QuestionsFrom, folder: Path) -> Path:
    """Have ``writer`` write the questions of ``settings`` about ``corpus``'s chunks
    (:func:`~ragfix.connectors.synthetic.write_questions`, in batches of the backend's preferred
    size, else 8) and keep the pairs its filter passed in ``folder`` /
    :data:`WRITTEN_QUESTIONS` (one question-file record a line), with ``folder`` /
    :data:`WRITTEN_REPORT` (``model``, ``asked``, ``kept``, ``dropped`` by reason and, when the
    corpus has copies of its documents, ``copies``).

    Args:
        writer: the writing model's :class:`~ragfix.backends.Backend` (loaded by the caller).
        corpus: the chunked corpus (:func:`~ragfix.connectors.corpus.build_corpus`).
        settings: the writing model, number of chunks and seed.
        folder: the run folder (exists).

    Returns:
        the question file's path.

    Raises:
        DataError: no written question passed the filter (the counts per reason; the files of
            the corpus that are copies of others named, their answers being in two chunks).
    """
    written = Path(folder) / WRITTEN_QUESTIONS
    made = write_questions(writer, corpus.nodes, settings, writer.preferred_batch_size or 8)
    copies = {"copies": corpus.copies} if corpus.copies else {}
    if not made.records:
        why = ", ".join(f"{k} {v}" for k, v in made.dropped.items())
        if corpus.copies:
            why += (
                f"; {len(corpus.copies)} file(s) of {corpus.path} are copies of others, and an "
                "answer in one is in its copy too (answer_in_other_chunk): "
                f"{describe_copies(corpus.copies)}; remove the copies"
            )
        raise DataError(written, None, None, f"no written question passed the filter ({why})")
    atomic_write_text(written, "".join(json.dumps(r) + "\n" for r in made.records))
    atomic_write_json(
        Path(folder) / WRITTEN_REPORT, {"model": settings.model, **made.report(), **copies}
    )
    return written
