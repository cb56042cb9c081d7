"""Questions made from a user's own corpus, no labels needed: needle facts planted in its chunks
(:func:`plant_needles`) and questions an LLM writes about its chunks (:func:`write_questions`).

* Needles (needle-in-a-haystack, RULER style, but through a retriever): ``count`` chunks are
  drawn with a seeded generator among the corpus's full-size chunks, and one sentence ``The secret
  code of the <key> is <value>.`` is inserted into each, at a seeded sentence boundary; the key
  (two words) and the value (seven digits) occur nowhere else in the corpus (checked on the
  normalised documents) and in no other needle. The chunk keeps its size class: words at the
  chunk's far end from the needle are dropped until it has no more embedder tokens than the
  corpus's largest chunk, so the needle does not dominate its embedding. Each needle is asked as
  ``What is the secret code of the <key>?``, answer the value, gold chunk known by construction.
  The pipeline sweep leaves the other needles' chunks out of each needle question's retrieval
  (:func:`ragfix.eval.pipeline.run_pipeline_sweep`): every question is answered among the
  corpus's own chunks, as if its needle were the only one planted.
* Written questions: the model reads each of ``chunks`` seeded sampled chunks and writes a
  question and a short answer (:data:`WRITE_PROMPT`). A pair is kept when it parses, its answer
  (normalised, :func:`~ragfix.metrics.normalize_answer`, whole words) occurs in its chunk, in
  no other chunk and not in its question (which would give it away), its question shares no
  8-word shingle with the chunk (it does not quote it) and no kept question is the same after
  normalisation; every drop is counted by reason (:data:`DROP_REASONS`). The kept pairs are
  question-file records (``question``, ``answers``, ``gold_text``: what
  :func:`~ragfix.connectors.corpus.read_questions` reads).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from ragfix.errors import RagfixError
from ragfix.metrics import normalize_answer
from ragfix.prompts import TaskPrompt
from ragfix.pruning import shingles

#: the needle sentence and its question (``key``: two words, ``value``: seven digits)
NEEDLE_SENTENCE = "The secret code of the {key} is {value}."
NEEDLE_QUESTION = "What is the secret code of the {key}?"
_ADJECTIVES = (
    "amber",
    "azure",
    "bronze",
    "cobalt",
    "copper",
    "crimson",
    "emerald",
    "golden",
    "granite",
    "indigo",
    "ivory",
    "jade",
    "lilac",
    "maroon",
    "ochre",
    "onyx",
    "pearl",
    "russet",
    "saffron",
    "scarlet",
    "silver",
    "teal",
    "umber",
    "violet",
)
_NOUNS = (
    "albatross",
    "badger",
    "beacon",
    "bison",
    "compass",
    "falcon",
    "ferret",
    "gazelle",
    "harbor",
    "heron",
    "ibis",
    "jackal",
    "kestrel",
    "lantern",
    "marmot",
    "otter",
    "pelican",
    "quarry",
    "raven",
    "sextant",
    "tapir",
    "walrus",
    "wren",
    "yak",
)
#: a sentence boundary inside a chunk: the space after a full stop (or ! ?), or a blank line
_BOUNDARY = re.compile(r"[.!?][\"')\]]*\s+|\n\s*\n")
_ATTEMPTS = 1000


class NeedleError(RagfixError):
    """Needles that cannot be planted in this corpus (too few full-size chunks, chunks too small
    for a needle sentence)."""


class NeedleSettings(BaseModel):
    """How needles are planted (frozen, validated when built, unknown fields refused).

    Attributes:
        count: needles, one per chunk (``--needles``).
        seed: the generator of the chunks, keys, values and insertion points (``--needle-seed``):
            the same seed over the same corpus and chunking plants the same needles.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    count: int = Field(ge=1)
    seed: int = 0


class Needle(BaseModel):
    """One planted fact.

    Attributes:
        id: ``needle-NNN`` (its draw order).
        key, value: the fact: the answer to :attr:`question` is ``value``.
        question: ``What is the secret code of the <key>?``.
        sentence: the sentence inserted into the chunk.
        node_id: the chunk holding the sentence (the gold chunk).
    """

    model_config = ConfigDict(frozen=True)
    id: str
    key: str
    value: str
    question: str
    sentence: str
    node_id: str


def _padded(text: str) -> str:
    return f" {normalize_answer(text)} "


def occurs(phrase: str, padded_text: str) -> bool:
    """Whether normalised ``phrase`` occurs as whole words in ``padded_text`` (a text through
    :func:`~ragfix.metrics.normalize_answer`, one space added at each end); an empty phrase
    never occurs."""
    norm = normalize_answer(phrase)
    return bool(norm) and f" {norm} " in padded_text


def insert_sentence(
    text: str, sentence: str, boundary: int, budget: int, count_tokens: Callable[[str], int]
) -> str:
    """``text`` with ``sentence`` inserted at its ``boundary``-th sentence boundary (0: before the
    first sentence; the last: after the end; boundaries are the starts of sentences after
    ``.``/``!``/``?`` and blank lines), then words dropped from whichever side of it is longer,
    at that side's far end, until the text has at most ``budget`` tokens (``count_tokens``).

    Raises:
        ValueError: ``boundary`` is not one of the text's boundaries.
    """
    text = text.strip()
    points = _boundaries(text)
    if not 0 <= boundary < len(points):
        raise ValueError(f"boundary {boundary} of {len(points)}")
    before, after = text[: points[boundary]].rstrip(), text[points[boundary] :].lstrip()

    def joined() -> str:
        return " ".join(p for p in (before, sentence, after) if p)

    while count_tokens(joined()) > budget and (before or after):
        if len(before) > len(after):
            before = re.sub(r"^\S+\s*", "", before, count=1)
        else:
            after = re.sub(r"\s*\S+$", "", after, count=1)
    return joined()


def _boundaries(text: str) -> list[int]:
    """The character offsets of ``text``'s sentence boundaries, its start and end included."""
    return sorted({0, *(m.end() for m in _BOUNDARY.finditer(text)), len(text)})


def plant_needles(
    nodes: Sequence,
    settings: NeedleSettings,
    documents: Sequence[str],
    count_tokens: Callable[[str], int],
) -> list[Needle]:
    """Plant ``settings.count`` needles into ``nodes`` (LlamaIndex text nodes, in corpus order;
    each chosen node's text is replaced), one per node; returns the needles in draw order.

    Args:
        nodes: the corpus's chunks.
        settings: count and seed.
        documents: the full text of every document (where a key or value must not occur).
        count_tokens: the embedder's token counter (the size of a chunk).

    Raises:
        NeedleError: fewer full-size chunks (at least half the largest chunk's tokens) than
            needles, a needle sentence longer than half the largest chunk, or no fresh key or
            value found.
    """
    from llama_index.core.schema import MetadataMode

    rng = random.Random(settings.seed)
    texts = [n.get_content(metadata_mode=MetadataMode.NONE) for n in nodes]
    sizes = [count_tokens(t) for t in texts]
    budget = max(sizes, default=0)
    full = [i for i, s in enumerate(sizes) if s * 2 >= budget and texts[i].strip()]
    if len(full) < settings.count:
        raise NeedleError(
            f"{settings.count} needles need as many chunks of at least {budget // 2} tokens "
            f"(half the largest chunk); the corpus has {len(full)}"
        )
    corpus = [_padded(t) for t in documents]
    used_keys: set[str] = set()
    used_values: set[str] = set()

    def fresh(draw: Callable[[], str], used: set[str]) -> str:
        for _ in range(_ATTEMPTS):
            x = draw()
            if x not in used and not any(occurs(x, d) for d in corpus):
                used.add(x)
                return x
        raise NeedleError("no needle key or value found that the corpus does not contain")

    chosen = rng.sample(full, settings.count)
    out = []
    for k, i in enumerate(chosen):
        key = fresh(lambda: f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}", used_keys)
        value = fresh(lambda: str(rng.randrange(1_000_000, 10_000_000)), used_values)
        sentence = NEEDLE_SENTENCE.format(key=key, value=value)
        if count_tokens(sentence) * 2 > budget:
            raise NeedleError(
                f"chunks of at most {budget} tokens are too small for a needle sentence of "
                f"{count_tokens(sentence)} tokens: use a chunk size of at least "
                f"{2 * count_tokens(sentence)}"
            )
        at = rng.randrange(len(_boundaries(texts[i].strip())))
        node = nodes[i]
        node.set_content(insert_sentence(texts[i], sentence, at, budget, count_tokens))
        node.start_char_idx = node.end_char_idx = None  # no longer a span of its document
        out.append(
            Needle(
                id=f"needle-{k:03d}",
                key=key,
                value=value,
                question=NEEDLE_QUESTION.format(key=key),
                sentence=sentence,
                node_id=node.node_id,
            )
        )
    return out


# ---------------------------------------------------------------------- written questions

WRITE_PROMPT = (
    "Read the passage and write one question that it answers, with the answer: a few words "
    "copied from the passage. Ask in your own words; do not copy a sentence of the passage into "
    "the question.\n\nPassage: {text}\n\nReply in two lines:\nQuestion: <the question>\n"
    "Answer: <the answer>"
)
"""What the question-writing model reads per chunk (its reply opens with ``Question:``)."""
WRITE_PREFIX = "Question:"
#: why a written pair is dropped, in the order the filter checks
DROP_REASONS = (
    "unparsed",
    "answer_not_in_chunk",
    "answer_in_other_chunk",
    "answer_in_question",
    "quotes_chunk",
    "duplicate",
)
#: shingle length (words) a question may not share with its chunk
QUOTE_WORDS = 8
_REPLY = re.compile(r"^\s*(?:question:\s*)?(?P<q>.+?)\s*answer:\s*(?P<a>[^\n]+)", re.I | re.S)


class QuestionsFrom(BaseModel):
    """How an LLM writes the questions of a run (frozen, validated when built).

    Attributes:
        model: the writing model (``smollm2``, a Hugging Face id or folder, a GGUF file,
            ``openai:NAME``), run as the ``vanilla`` backend.
        chunks: chunks sampled, one question asked of each (fewer are kept: the filter).
        seed: the generator that samples the chunks.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str = Field(min_length=1)
    chunks: int = Field(default=20, ge=1)
    seed: int = 0


@dataclass
class WrittenQuestions:
    """What :func:`write_questions` made.

    Attributes:
        records: the kept pairs as question-file records (``id``, ``question``, ``answers``,
            ``gold_text``), in sampling order.
        asked: chunks the model was asked about.
        dropped: ``{reason: count}`` for every reason of :data:`DROP_REASONS` (zeros included).
    """

    records: list[dict]
    asked: int
    dropped: dict[str, int] = field(default_factory=dict)

    def report(self) -> dict:
        """``{"asked", "kept", "dropped"}`` (what the run folder keeps beside the file)."""
        return {"asked": self.asked, "kept": len(self.records), "dropped": self.dropped}


def parse_written(text: str) -> tuple[str, str] | None:
    """``(question, answer)`` of a reply to :data:`WRITE_PROMPT` (after its ``Question:``
    prefix), or ``None`` when it has no ``Answer:`` line or an empty part."""
    m = _REPLY.match(text)
    if not m:
        return None
    q, a = " ".join(m["q"].split()), m["a"].strip().strip('"').strip()
    return (q, a) if q and a else None


def write_questions(
    backend, nodes: Sequence, settings: QuestionsFrom, batch_size: int = 8
) -> WrittenQuestions:
    """Ask ``backend`` for a question and answer about each of ``settings.chunks`` chunks of
    ``nodes`` (sampled with ``settings.seed``; all of them when there are fewer) and filter the
    pairs (see the module docstring).

    Args:
        backend: any :class:`~ragfix.backends.Backend` (only ``generate`` is called, greedy).
        nodes: the corpus's chunks (LlamaIndex text nodes).
        settings: the model, number of chunks and seed (the model is the caller's to load).
        batch_size: prompts per ``generate`` call.
    """
    from llama_index.core.schema import MetadataMode

    texts = [n.get_content(metadata_mode=MetadataMode.NONE) for n in nodes]
    usable = [i for i, t in enumerate(texts) if t.strip()]
    rng = random.Random(settings.seed)
    picked = rng.sample(usable, min(settings.chunks, len(usable)))
    prompts = [
        TaskPrompt(
            user=WRITE_PROMPT.format(text=texts[i].strip()),
            assistant_prefix=WRITE_PREFIX,
            max_new_tokens=64,
            stop_at_newline=False,
        )
        for i in picked
    ]
    replies = []
    for start in range(0, len(prompts), batch_size):
        gens = backend.generate(prompts[start : start + batch_size], batch_size=batch_size)
        replies += [g.text for g in gens]
    padded = [_padded(t) for t in texts]
    dropped = dict.fromkeys(DROP_REASONS, 0)
    seen: set[str] = set()
    records = []
    for i, reply in zip(picked, replies, strict=True):
        reason = None
        pair = parse_written(reply)
        if pair is None:
            reason = "unparsed"
        else:
            q, a = pair
            if not occurs(a, padded[i]):
                reason = "answer_not_in_chunk"
            elif any(occurs(a, p) for j, p in enumerate(padded) if j != i):
                reason = "answer_in_other_chunk"
            elif occurs(a, _padded(q)):
                reason = "answer_in_question"
            elif shingles(q, QUOTE_WORDS) & shingles(texts[i], QUOTE_WORDS):
                reason = "quotes_chunk"
            elif normalize_answer(q) in seen:
                reason = "duplicate"
        if reason is not None:
            dropped[reason] += 1
            continue
        seen.add(normalize_answer(q))
        records.append(
            {
                "id": f"written-{len(records):03d}",
                "question": q,
                "answers": [a],
                "gold_text": texts[i].strip(),
            }
        )
    return WrittenQuestions(records=records, asked=len(picked), dropped=dropped)
