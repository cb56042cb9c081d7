"""The Haystack integration in a real pipeline: an in-memory document store embedded by the
embedded MiniLM (sentence-transformers-haystack), ``InMemoryEmbeddingRetriever``,
``RagFixRanker``, the ``qa`` prompt builder and ``RagFixChatGenerator`` over the real SmolLM2.
Placement and budget fitting are read off the prompt the model actually received; the pipeline
goes to YAML and back."""

from __future__ import annotations

import pytest
from conftest import CITY_TEXTS
from haystack import Document, Pipeline
from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever
from haystack.dataclasses import ChatMessage
from haystack.document_stores.in_memory import InMemoryDocumentStore
from pydantic import ValidationError

from ragfix.errors import ConfigError
from ragfix.integrations.haystack import (
    RagFixChatGenerator,
    RagFixRanker,
    document_embedder,
    qa_prompt_builder,
    text_embedder,
)
from ragfix.postprocessor import text_qa_template
from ragfix.prompts import TaskPrompt
from ragfix.pruning import BudgetError

QUESTION = "What is the capital of Germany?"


@pytest.fixture(scope="module")
def store():
    docs = [
        Document(content=t, meta={"title": f"City {i}"}, id=f"d{i}")
        for i, t in enumerate(CITY_TEXTS)
    ]
    store = InMemoryDocumentStore(embedding_similarity_function="cosine")
    store.write_documents(document_embedder().run(docs)["documents"])
    return store


def _pipeline(store, ranker, llm) -> Pipeline:
    pipe = Pipeline()
    pipe.add_component("embedder", text_embedder())
    pipe.add_component("retriever", InMemoryEmbeddingRetriever(store, top_k=4))
    pipe.add_component("ranker", ranker)
    pipe.add_component("prompt", qa_prompt_builder())
    pipe.add_component("llm", llm)
    pipe.connect("embedder.embedding", "retriever.query_embedding")
    pipe.connect("retriever.documents", "ranker.documents")
    pipe.connect("ranker.context", "prompt.context")
    pipe.connect("prompt.prompt", "llm.messages")
    return pipe


def _run(pipe: Pipeline) -> dict:
    inputs = {"embedder": {"text": QUESTION}, "ranker": {"query": QUESTION}}
    inputs["prompt"] = {"query": QUESTION}
    return pipe.run(inputs, include_outputs_from={"retriever", "ranker"})


def _where(prompt: str, docs: list[Document]) -> list[int]:
    return [prompt.index(f"Document (Title: {d.meta['title']}) {d.content}") for d in docs]


def test_pipeline_reads_the_documents_in_strategy_order_and_survives_yaml(store, smol):
    ranker = RagFixRanker(strategy="reverse", backend=smol)
    llm = RagFixChatGenerator(smol, max_new_tokens=8, stop_at_newline=True)
    pipe = _pipeline(store, ranker, llm)
    out = _run(pipe)
    retrieved = out["retriever"]["documents"]
    assert retrieved[0].id == "d0"  # the embedder finds Berlin
    assert [d.id for d in out["ranker"]["documents"]] == [d.id for d in retrieved[::-1]]
    assert llm.calls == 1 and out["llm"]["replies"][0].text == llm.last_generation.text
    where = _where(llm.last_prompt, retrieved[::-1])
    assert where == sorted(where)  # the model read them best last
    # the same user turn LlamaIndex builds from the same chunks
    context = out["ranker"]["context"]
    user = text_qa_template().format(context_str=context, query_str=QUESTION)
    assert llm.last_prompt == smol.format_prompt(TaskPrompt(user=user))
    # to YAML and back: the settings and the backend reference survive, the prompt is the same
    yaml = pipe.dumps()
    assert "strategy: reverse" in yaml and "model: smollm2" in yaml and "name: vanilla" in yaml
    loaded = Pipeline.loads(yaml, allowed_modules=["ragfix.integrations.haystack"])
    again = loaded.get_component("ranker").run(retrieved, QUESTION)
    assert again["context"] == context
    assert loaded.get_component("ranker").settings == ranker.settings


def test_budget_and_duplicates_are_fitted_on_the_prompt_the_model_gets(store, smol):
    docs = store.filter_documents()[:4]
    docs.insert(1, Document(content=docs[0].content, meta=docs[0].meta, id="dup"))
    docs.append(Document(content=None, id="no-text"))
    chunk = [f"Document (Title: {d.meta['title']}) {d.content}" for d in docs[:5]]
    sizes = [smol.count_tokens(c) for c in chunk]
    budget = sizes[0] + sizes[2] + sizes[3]  # the best, then two more (the copy is dropped)
    ranker = RagFixRanker(strategy="lost-in-the-middle", backend=smol, token_budget=budget)
    out = ranker.run(docs, QUESTION)
    rep = ranker.last_report
    assert rep["dropped_blank"] == ["no-text"] and rep["dropped_duplicates"] == ["dup"]
    assert rep["dropped_budget"] == [docs[4].id]
    kept = out["documents"]
    assert [d.id for d in kept] == [docs[0].id, docs[3].id, docs[2].id]
    llm = RagFixChatGenerator(smol, max_new_tokens=4)
    prompt = qa_prompt_builder().run(context=out["context"], query=QUESTION)["prompt"]
    llm.run(prompt)
    where = _where(llm.last_prompt, kept)
    assert where == sorted(where) and docs[4].content not in llm.last_prompt
    tight = RagFixRanker(strategy="none", backend=smol, token_budget=sizes[0] - 1)
    with pytest.raises(BudgetError, match="best passage"):
        tight.run(docs)


def test_settings_are_validated_when_built_and_backends_load_lazily(smol):
    with pytest.raises(ValidationError, match="dedup_treshold"):
        RagFixRanker(strategy="none", dedup_treshold=0.5)
    with pytest.raises(ValidationError, match="unknown reorder strategy"):
        RagFixRanker(strategy="random")
    with pytest.raises(ConfigError, match="token_budget=9000 is larger than the 8192-token"):
        RagFixRanker(backend=smol, token_budget=9000)
    with pytest.raises(ConfigError, match="unknown backend 'nope'"):
        RagFixRanker(backend={"name": "nope"})
    with pytest.raises(ValidationError, match="max_new_token\n"):
        RagFixChatGenerator(smol, max_new_token=5)
    with pytest.raises(ConfigError, match="needs backend"):
        RagFixChatGenerator(None)
    # a backend named by reference is loaded in warm_up, once for every component naming it
    ref = {"name": "vanilla", "model": "smollm2", "device": "cpu"}
    ranker, llm = RagFixRanker(backend=ref, strategy="reverse"), RagFixChatGenerator(ref)
    assert llm.calls == 0 and llm.last_prompt is None
    ranker.warm_up()
    llm.warm_up()
    assert ranker._correction.backend is llm._answerer.backend


def test_generator_streams_and_refuses_other_turns(smol):
    llm = RagFixChatGenerator(smol, max_new_tokens=12, stop_at_newline=True)
    ask = [ChatMessage.from_user("What is the capital of France? Answer in one sentence.")]
    full = llm.run(ask)["replies"][0].text
    pieces: list[str] = []
    streamed = llm.run(ask, streaming_callback=lambda c: pieces.append(c.content))
    assert len(pieces) > 1 and "".join(pieces) == full == streamed["replies"][0].text
    assert "Paris" in full
    with pytest.raises(ConfigError, match="one user message, got: system, user"):
        llm.run([ChatMessage.from_system("Be brief."), *ask])


def test_c11_every_text_part_is_read_and_other_parts_refused(smol):
    """C11 (deepset-ai/haystack#9676): ``ChatMessage.from_user(content_parts=["What is the
    capital", " of France?"])`` was read as its first part only (the answer was about "the
    capital of the United States"). Every text part is read, joined as ``ragfix serve`` joins
    text parts (nothing between them), so the model reads the prompt of the one-string message;
    a part that is not text is refused in one line."""
    from haystack.dataclasses import ImageContent

    from ragfix.serve import Message

    q = "What is the capital of France?"
    llm = RagFixChatGenerator(smol, max_new_tokens=24)
    one = llm.run([ChatMessage.from_user(q)])["replies"][0].text
    read = llm.last_prompt
    parts = ["What is the capital", " of France?"]
    two = llm.run([ChatMessage.from_user(content_parts=parts)])["replies"][0].text
    assert llm.last_prompt == read and q in read and two == one and "France" in two
    served = Message(role="user", content=[{"type": "text", "text": p} for p in parts])
    assert served.text() == q  # the served endpoint's rule
    pieces: list[str] = []
    llm.run(
        [ChatMessage.from_user(content_parts=parts)],
        streaming_callback=lambda c: pieces.append(c.content),
    )
    assert "".join(pieces) == one
    image = ImageContent(base64_image="iVBORw0KGgo=", mime_type="image/png")
    with pytest.raises(
        ConfigError,
        match=r"^RagFixChatGenerator reads text only: part 1 of the user message is 'image'$",
    ):
        llm.run([ChatMessage.from_user(content_parts=[q, image])])


def test_c11_a_served_model_reads_every_text_part():
    """C11 through a stand-in server on 127.0.0.1: the remote backend under
    ``RagFixChatGenerator`` sends the joined text parts (the prompt the server receives holds
    the whole question)."""
    from fake_openai import FakeOpenAI

    from ragfix.backends import load_backend

    with FakeOpenAI() as fake:
        remote = load_backend(
            "vanilla", model="openai:fake", api_base=fake.url, tokenizer="smollm2"
        )
        llm = RagFixChatGenerator(remote, max_new_tokens=8)
        parts = ["What is the capital", " of France?"]
        reply = llm.run([ChatMessage.from_user(content_parts=parts)])["replies"][0]
        assert reply.text == "Paris"
        assert reply.meta["prompt_tokens"] == len(remote.encode(llm.last_prompt))
        [body] = fake.bodies
    assert body["prompt"] == llm.last_prompt and "What is the capital of France?" in body["prompt"]
