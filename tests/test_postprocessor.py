"""RagFixPostprocessor, RagFixLLM and the document-folder connector, inside a real LlamaIndex
query engine (real FAISS index, real all-MiniLM-L6-v2 embedder, real SmolLM2)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from conftest import CITY_TEXTS
from llama_index.core.schema import NodeWithScore, TextNode
from pydantic import ValidationError

from ragfix.connectors.corpus import CorpusError, build_corpus, load_documents, load_questions
from ragfix.connectors.jsonl import SkipCounter
from ragfix.errors import ConfigError, DataError
from ragfix.llm import RagFixLLM
from ragfix.postprocessor import RagFixPostprocessor
from ragfix.pruning import BudgetError
from ragfix.reorder import ProfileError


def _nodes(scores=None):
    return [
        NodeWithScore(node=TextNode(text=t, id_=f"n{i}"), score=None if scores is None else s)
        for i, (t, s) in enumerate(zip(CITY_TEXTS, scores or [None] * len(CITY_TEXTS), strict=True))
    ]


@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("none", [0, 1, 2, 3, 4]),
        ("reverse", [4, 3, 2, 1, 0]),
        ("lost-in-the-middle", [0, 2, 4, 3, 1]),
    ],
)
def test_static_strategies_on_nodes_without_scores(strategy, expected):
    post = RagFixPostprocessor(strategy=strategy)
    out = post.postprocess_nodes(_nodes(), query_str="capital?")
    assert [n.node.node_id for n in out] == [f"n{i}" for i in expected]
    assert post.last_report["order"] == expected


def test_async_path_matches_sync():
    post = RagFixPostprocessor(strategy="lost-in-the-middle")
    nodes = _nodes([0.9, 0.8, 0.7, 0.6, 0.5])
    out = asyncio.run(post.apostprocess_nodes(nodes, query_str="capital?"))
    assert [n.node.node_id for n in out] == ["n0", "n2", "n4", "n3", "n1"]
    assert [n.score for n in out] == [0.9, 0.7, 0.5, 0.6, 0.8]


def test_settings_are_pydantic_fields_and_backend_is_private(smol):
    post = RagFixPostprocessor(strategy="reverse", backend=smol, reserve_tokens=100)
    d = post.to_dict()
    assert d["class_name"] == "RagFixPostprocessor" and d["strategy"] == "reverse"
    assert "backend" not in d and "_backend" not in d
    with pytest.raises(ValueError, match="unknown reorder strategy"):
        RagFixPostprocessor(strategy="random")
    with pytest.raises(ValueError, match="needs backend"):
        RagFixPostprocessor(strategy="attention-sort")


def test_duplicates_and_budget_keep_the_best_nodes(smol):
    nodes = _nodes()
    nodes.insert(2, NodeWithScore(node=TextNode(text=CITY_TEXTS[0], id_="dup")))
    sizes = [smol.count_tokens(t) for t in CITY_TEXTS]
    post = RagFixPostprocessor(strategy="none", backend=smol, token_budget=sum(sizes[:3]))
    out = post.postprocess_nodes(nodes, query_str="capital?")
    assert [n.node.node_id for n in out] == ["n0", "n1", "n2"]
    assert post.last_report["dropped_duplicates"] == ["dup"]
    assert post.last_report["dropped_budget"] == ["n3", "n4"]
    tight = RagFixPostprocessor(strategy="none", backend=smol, token_budget=sizes[0] - 1)
    with pytest.raises(BudgetError, match="best passage"):
        tight.postprocess_nodes(nodes, query_str="capital?")


def test_bias_profile_checks_model_and_size(tmp_path, smol):
    summary = {
        "model": "smollm2",
        "num_docs": 5,
        "curves": {
            "vanilla": {
                "positions": [
                    {"position": p, "accuracy": a} for p, a in enumerate([0.9, 0.2, 0.3, 0.4, 0.8])
                ]
            }
        },
    }
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    post = RagFixPostprocessor(strategy="bias-profile", profile=str(path), backend=smol)
    out = post.postprocess_nodes(_nodes(), query_str="capital?")
    # positions by accuracy 0, 4, 3, 2, 1 receive ranks 0..4
    assert [n.node.node_id for n in out] == ["n0", "n4", "n3", "n2", "n1"]
    with pytest.raises(ProfileError, match="for 5 documents, not 10"):
        RagFixPostprocessor(strategy="bias-profile", profile=str(path), backend=smol, num_docs=10)
    summary["model"] = "qwen"
    path.write_text(json.dumps(summary))
    with pytest.raises(ProfileError, match="model 'qwen', not 'smollm2'"):
        RagFixPostprocessor(strategy="bias-profile", profile=str(path), backend=smol)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i, t in enumerate(CITY_TEXTS[:3]):
        (d / f"doc{i}.txt").write_text(t)
    (d / "doc3.md").write_text(f"# Australia\n\n{CITY_TEXTS[3]}")
    (d / "doc4.html").write_text(f"<html><body><p>{CITY_TEXTS[4]}</p></body></html>")
    (d / "blob.txt").write_bytes(b"\x00\x01\x02binary")
    (d / "notes.csv").write_text("ignored,file")
    return d


def test_folder_reading_skips_and_counts_bad_files(folder, tmp_path):
    skipped = SkipCounter()
    docs = load_documents(folder, skipped)
    assert sorted(d.id_ for d in docs) == [
        f"doc{i}.{e}" for i, e in enumerate(["txt", "txt", "txt", "md", "html"])
    ]
    assert skipped.count == 1 and "blob.txt" in skipped.examples[0]
    html = next(d for d in docs if d.id_ == "doc4.html")
    assert html.text.strip() == CITY_TEXTS[4]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no readable documents"):
        load_documents(tmp_path / "empty")


def test_query_engine_passes_nodes_in_strategy_order(folder, smol):
    corpus = build_corpus(folder, chunk_size=64, chunk_overlap=0)
    assert len(corpus.nodes) == 5
    assert not build_corpus(folder, chunk_size=64, chunk_overlap=0).rebuilt  # persisted index
    with pytest.raises(CorpusError, match="top-k 6 is larger than the corpus"):
        corpus.retriever("faiss", 6)
    llm = RagFixLLM(smol, max_new_tokens=8, stop_at_newline=True)
    post = RagFixPostprocessor(strategy="reverse", backend=smol)
    engine = corpus.index.as_query_engine(
        llm=llm, similarity_top_k=4, node_postprocessors=[post], response_mode="compact"
    )
    resp = engine.query("What is the capital of Germany?")
    assert llm.calls == 1
    retrieved = corpus.retriever("faiss", 4).retrieve("What is the capital of Germany?")
    assert retrieved[0].node.metadata["doc_id"] == "doc0.txt"  # the embedder finds Berlin
    expected = [n.node.get_content() for n in reversed(retrieved)]
    assert [n.node.get_content() for n in resp.source_nodes] == expected
    flat = " ".join(llm.last_prompt.split())  # synthesis may re-space the context
    where = [flat.index(" ".join(t.split())) for t in expected]
    assert where == sorted(where)  # the LLM read them in the reversed order
    assert llm.last_prompt.startswith("<|im_start|>system")
    bm25 = corpus.retriever("bm25", 2).retrieve("capital of Kenya")
    assert bm25[0].node.metadata["doc_id"] == "doc4.html"


def test_each_chunking_keeps_its_own_index(folder, tmp_path, monkeypatch):
    # issue 14: build_corpus and the sweep chunk alike by default, and an index built with other
    # settings is kept beside it instead of being rebuilt each time the settings alternate;
    # issue 33: in the ragfix cache, keyed by content, never in the user's folder
    from ragfix.connectors.corpus import DEFAULT_CHUNK_SIZE

    monkeypatch.setenv("RAGFIX_CACHE", str(tmp_path / "cache"))
    folder = shutil.copytree(folder, tmp_path / "docs")
    listing = sorted(folder.rglob("*"))

    a = build_corpus(folder, chunk_overlap=0)
    b = build_corpus(folder, chunk_size=16, chunk_overlap=0)
    assert a.rebuilt and b.rebuilt
    again = build_corpus(folder, chunk_size=DEFAULT_CHUNK_SIZE, chunk_overlap=0)
    assert not again.rebuilt and [n.node_id for n in again.nodes] == [n.node_id for n in a.nodes]
    assert not build_corpus(folder, chunk_size=16, chunk_overlap=0).rebuilt
    assert sorted(p.name.split("-")[0] for p in a.where.parent.iterdir()) == [
        "chunk16",
        f"chunk{DEFAULT_CHUNK_SIZE}",
    ]
    assert a.where.parent.parent == tmp_path / "cache" / "indexes"
    assert sorted(folder.rglob("*")) == listing  # nothing written into the corpus
    # a copy of the same files shares the index; an edited file gets a new one
    copy = shutil.copytree(folder, tmp_path / "copy" / "docs")
    assert not build_corpus(copy, chunk_overlap=0).rebuilt
    (copy / "doc0.txt").write_text(CITY_TEXTS[0] + " It lies on the Spree.")
    edited = build_corpus(copy, chunk_overlap=0)
    assert edited.rebuilt and edited.where.parent != a.where.parent
    assert "Spree" in edited.nodes[0].get_content()


def test_a_bad_question_file_fails_before_the_corpus_is_indexed(folder, tmp_path, monkeypatch):
    from ragfix.eval.pipeline import run_pipeline_sweep

    monkeypatch.setenv("RAGFIX_CACHE", str(tmp_path / "cache"))
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question": "capital of Kenya?", "answers": "Nairobi"}) + "\n")
    with pytest.raises(DataError, match=r"q.jsonl:1: answers: expected list"):
        run_pipeline_sweep(folder, q, tmp_path / "run", ["none"], top_k=2)
    assert not (tmp_path / "cache" / "indexes").exists()


def test_questions_with_missing_gold_are_clear_errors(folder, tmp_path):
    corpus = build_corpus(folder, chunk_size=64, chunk_overlap=0)
    q = tmp_path / "q.jsonl"
    q.write_text(
        json.dumps(
            {"question": "capital of Kenya?", "answers": ["Nairobi"], "gold_doc_id": "doc4.html"}
        )
        + "\n"
        + json.dumps(
            {"question": "capital of Peru?", "answers": ["Lima"], "gold_text": "Lima is in Peru."}
        )
        + "\n"
    )
    with pytest.raises(DataError, match=r"q.jsonl:2: gold_text: gold passage not found"):
        load_questions(q, corpus.nodes)
    skipped = SkipCounter()
    qs = load_questions(q, corpus.nodes, skip_invalid=True, skipped=skipped)
    assert [x.gold_node_id for x in qs] == ["doc4.html#0"] and skipped.count == 1


def test_llm_metadata_and_streaming(smol):
    llm = RagFixLLM(smol, max_new_tokens=12)
    meta = llm.metadata
    assert meta.context_window == smol.context_window == 8192
    assert meta.num_output == 12 and meta.model_name == "smollm2 (vanilla)"
    prompt = "What is the capital of France? Answer in one sentence."
    full = llm.complete(prompt).text
    pieces = list(llm.stream_complete(prompt))
    assert len(pieces) > 1  # token by token, not one block
    assert "".join(p.delta for p in pieces) == full
    assert pieces[-1].text == full
    assert "Paris" in full


def _spy_stream(smol, monkeypatch) -> list:
    """Record what the LLM reads from ``smol.stream`` and when it closes the stream."""
    events: list = []
    real = smol.stream

    def spy(*args, **kwargs):
        events.append(kwargs)
        it = real(*args, **kwargs)
        try:
            for piece in it:
                events.append(piece)
                yield piece
        finally:
            events.append("closed")
            it.close()

    monkeypatch.setattr(smol, "stream", spy)
    return events


def test_streaming_closes_the_backend_stream_when_the_consumer_stops(smol, monkeypatch):
    events = _spy_stream(smol, monkeypatch)
    llm = RagFixLLM(smol, max_new_tokens=30)
    gen = llm.stream_complete("Write three sentences about Paris.")
    first = next(gen)
    assert first.delta and events[-1] == first.delta
    gen.close()
    assert events[-1] == "closed" and len(events) == 3  # kwargs, one piece, closed: no draining


def test_streaming_stops_at_the_newline_rule(smol, monkeypatch):
    events = _spy_stream(smol, monkeypatch)
    llm = RagFixLLM(smol, max_new_tokens=40, stop_at_newline=True)
    prompt = "List three fruits, one per line."
    pieces = list(llm.stream_complete(prompt))
    assert events[0] == {"max_new_tokens": 40, "stop_at_newline": True}
    assert events[-1] == "closed"
    text = pieces[-1].text
    assert "\n" not in text.strip() and text.strip() == llm.complete(prompt).text


def test_llm_prefix_reuse_gives_the_same_answers(tiny_qwen3_dir):
    """On the shared tiny Qwen3 (a stale or shifted cache entry changes its answers): the two
    prompts' answers differ, and prefix reuse gives each the answer computed without it."""
    from ragfix.backends import load_backend

    tiny = load_backend("vanilla", model=tiny_qwen3_dir, device="cpu")
    head = "Answer in one word. " * 20
    prompts = [head + "What is the capital of France?", head + "Which river runs through Rome?"]
    plain = RagFixLLM(tiny, max_new_tokens=6, stop_at_newline=True)
    reuse = RagFixLLM(tiny, max_new_tokens=6, stop_at_newline=True, prefix_reuse=True)
    answers = []
    for p in prompts:
        answers.append((plain.complete(p).text, reuse.complete(p).text))
    gen = reuse.last_generation
    assert [a for a, _ in answers] == [b for _, b in answers]
    assert answers[0][0] != answers[1][0]
    assert gen.prefill_tokens < gen.prompt_tokens - 100  # the shared head was not recomputed
    assert plain.last_generation.prefill_tokens == plain.last_generation.prompt_tokens


def test_unknown_settings_are_refused_and_budgets_checked_against_the_model(smol):
    """A typo is never ignored (pydantic extra="forbid"); budgets that cannot work with the
    model fail at construction naming both values."""
    with pytest.raises(ValidationError, match="dedup_treshold"):
        RagFixPostprocessor(strategy="none", dedup_treshold=0.5)
    with pytest.raises(ValidationError, match="max_new_token\n"):
        RagFixLLM(smol, max_new_token=5)
    with pytest.raises(ValidationError, match="over_budget"):
        RagFixPostprocessor(over_budget="ignore")
    with pytest.raises(ConfigError, match="token_budget=9000 is larger than the 8192-token"):
        RagFixPostprocessor(backend=smol, token_budget=9000)
    with pytest.raises(ConfigError, match="reserve_tokens=8192 leaves no token budget"):
        RagFixPostprocessor(backend=smol, reserve_tokens=8192)
    with pytest.raises(ConfigError, match="token_budget needs backend"):
        RagFixPostprocessor(token_budget=100)
    llm = RagFixLLM(smol, num_output=12)  # LlamaIndex's name for the output budget
    assert llm.max_new_tokens == llm.metadata.num_output == 12


def test_llm_refuses_a_prompt_that_does_not_fit_the_window(smol):
    """The prompt as the model reads it plus the output budget must fit the backend's window:
    refused before the model runs, never truncated."""
    llm = RagFixLLM(smol, num_output=8000, use_chat_template=False)
    prompt = "word " * 300
    size = smol.count_tokens(prompt)
    with pytest.raises(ConfigError, match=f"prompt has {size} tokens .* num_output=8000 .* 8192"):
        llm.complete(prompt)
    assert llm.calls == 0 and llm.last_prompt is None


def test_profile_size_mismatch_names_what_was_dropped(smol):
    nodes = _nodes()
    nodes.insert(1, NodeWithScore(node=TextNode(text=CITY_TEXTS[0], id_="dup")))
    nodes.append(NodeWithScore(node=TextNode(text="  ", id_="blank")))
    post = RagFixPostprocessor(strategy="bias-profile", profile=[0.5] * 6, backend=smol)
    with pytest.raises(ProfileError) as err:
        post.postprocess_nodes(nodes, query_str="capital?")
    assert str(err.value) == (
        "bias profile covers 6 documents but 5 passages were given; measure a profile with 5 "
        "documents (7 nodes given, dropped: 1 blank, 1 duplicates, set dedup_threshold=None)"
    )


def test_a_streamed_answer_joins_to_the_answer_in_every_framework(tiny_dir):
    """The tiny llama's answer to this prompt opens with a space (asserted on the backend's own
    stream), which the whole answer is stripped of: LlamaIndex's ``stream_complete``,
    LangChain's ``stream`` and Haystack's streaming callback each stream pieces that join to
    the answer their non-streaming call returns, with no empty piece."""
    from haystack.dataclasses import ChatMessage

    from ragfix.backends import load_backend
    from ragfix.integrations.haystack import RagFixChatGenerator
    from ragfix.integrations.langchain import RagFixChatModel

    tiny = load_backend("vanilla", model=tiny_dir, device="cpu")
    prompt = "What is the capital of France?"
    llm = RagFixLLM(tiny, max_new_tokens=8)
    raw = tiny.stream(llm._answerer.request(prompt), max_new_tokens=8, stop_at_newline=True)
    assert next(raw).startswith(" ")
    raw.close()
    full = llm.complete(prompt).text
    assert full and full == full.strip()
    deltas = [p.delta for p in llm.stream_complete(prompt)]
    assert all(deltas) and "".join(deltas) == full
    chat = RagFixChatModel(tiny, max_new_tokens=8)
    pieces = [c.content for c in chat.stream(prompt)]
    assert "".join(pieces) == chat.invoke(prompt).content == full
    gen, got = RagFixChatGenerator(tiny, max_new_tokens=8), []
    reply = gen.run(
        [ChatMessage.from_user(prompt)], streaming_callback=lambda c: got.append(c.content)
    )
    assert "".join(got) == reply["replies"][0].text == full
