"""``passages_from=``: the three frameworks' LLM components answer with a backend that reads a
prompt's passages where the prompt says they are (order marginalization, ``pine``), the spans
found in the framework's rendered prompt from the documents the correction component passed on.
Each framework runs a real pipeline over the real SmolLM2; every vote is checked against the
wrapped backend's own answer to that order of the same task prompt. PINE's spans and the
synthesizer's concurrent queries are plumbing checked on the shared tiny Qwen3
(``tiny_qwen3_dir``: SmolLM2's tokenizer and chat template, random weights whose peaked attention
moves the answer with the passages and their spans)."""

from __future__ import annotations

import pytest
from conftest import CITY_TEXTS
from haystack import Document as HaystackDocument
from haystack import Pipeline
from langchain_core.documents import Document as LangChainDocument
from llama_index.core.schema import NodeWithScore, TextNode

from ragfix.backends.orders import OrderOptions, marginalize_orders
from ragfix.errors import ConfigError
from ragfix.integrations.haystack import RagFixChatGenerator, RagFixRanker, qa_prompt_builder
from ragfix.integrations.langchain import (
    RagFixChatModel,
    RagFixCompressor,
    format_documents,
    qa_prompt,
)
from ragfix.llm import RagFixLLM
from ragfix.postprocessor import RagFixPostprocessor, text_qa_template
from ragfix.prompts import TaskPrompt, find_passages
from ragfix.tasks import join_chunks, render_chunk

QUESTION = "What is the capital of Germany?"
TITLES = [f"City {i}" for i in range(4)]
ANSWER = {"max_new_tokens": 8, "stop_at_newline": True}


def test_find_passages_by_hand():
    text = "Intro. alpha beta\n\ngamma\n\nalpha beta. End."
    # found (stripped), one missing (None, the search goes on from the last one found), and a
    # repeated text found after the one before it
    assert find_passages(text, ["  alpha beta\n", "delta", "gamma", "alpha beta"]) == [
        (7, 17),
        None,
        (19, 24),
        (26, 36),
    ]
    # a chunk that stands only before the previous one found is not there; a blank one never is
    assert find_passages(text, ["gamma", "Intro.", "  "]) == [(19, 24), None, None]


def _user(chunks: list[str]) -> str:
    """The qa user turn over ``chunks`` in prompt order, as all three frameworks render it."""
    return text_qa_template().format(context_str=join_chunks(chunks), query_str=QUESTION)


def _spans_by_hand(user: str, chunks: list[str]) -> tuple[tuple[int, int], ...]:
    return tuple((user.index(c), user.index(c) + len(c)) for c in chunks)


def _check_votes(smol, llm, plain_prompt: str, chunks: list[str]) -> None:
    """The component read what it reads without the option, and each vote is the wrapped
    backend's own answer to that order of the task prompt with the documents' spans."""
    user = _user(chunks)
    assert llm.last_prompt == plain_prompt == smol.format_prompt(TaskPrompt(user=user))
    votes = llm.last_generation.votes
    assert len(votes) == 3 and votes[0]["order"] == [0, 1, 2, 3]
    prompt = TaskPrompt(user=user, passages=_spans_by_hand(user, chunks), **ANSWER)
    singles = smol.generate([prompt.reordered(v["order"]) for v in votes], batch_size=1)
    assert [v["answer"] for v in votes] == [g.text for g in singles]
    assert llm.last_generation.text in [g.text for g in singles]


def _nodes() -> list[NodeWithScore]:
    return [
        NodeWithScore(
            node=TextNode(
                text=t,
                id_=f"n{i}",
                metadata={"title": TITLES[i]},
                metadata_template="{value}",
                text_template="Document (Title: {metadata_str}) {content}",
            ),
            score=None,
        )
        for i, t in enumerate(CITY_TEXTS[:4])
    ]


def _llama_engine(post, llm):
    from llama_index.core import get_response_synthesizer
    from llama_index.core.query_engine import RetrieverQueryEngine

    from ragfix.integrations.llama_index import _fixed_retriever_class

    fixed = _fixed_retriever_class()()
    fixed.nodes = _nodes()
    synth = get_response_synthesizer(
        llm=llm, response_mode="compact", text_qa_template=text_qa_template()
    )
    return RetrieverQueryEngine(
        retriever=fixed, response_synthesizer=synth, node_postprocessors=[post]
    )


def test_llamaindex_answers_over_orders_with_the_postprocessors_nodes(smol):
    post = RagFixPostprocessor(strategy="reverse", backend=smol)
    plain = RagFixLLM(smol, **ANSWER)
    _llama_engine(post, plain).query(QUESTION)
    wrapped = marginalize_orders(smol, OrderOptions(orders=3))
    llm = RagFixLLM(wrapped, passages_from=post, **ANSWER)
    resp = _llama_engine(post, llm).query(QUESTION)
    chunks = [render_chunk(TITLES[i], CITY_TEXTS[i]) for i in (3, 2, 1, 0)]
    assert post.last_passages == chunks
    _check_votes(smol, llm, plain.last_prompt, chunks)
    assert str(resp.response) == llm.last_generation.text
    # streamed: the marginal answer as one piece, the same text
    post.postprocess_nodes(_nodes())
    pieces = list(llm.stream_complete(llm_user := _user(chunks)))
    assert [p.delta for p in pieces] == [llm.last_generation.text]
    assert llm.last_prompt == smol.format_prompt(TaskPrompt(user=llm_user))


def _langchain_chain(compressor, chat):
    from langchain_classic.retrievers import ContextualCompressionRetriever
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    class Fixed(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager=None):
            return [
                LangChainDocument(page_content=t, metadata={"title": TITLES[i]}, id=f"d{i}")
                for i, t in enumerate(CITY_TEXTS[:4])
            ]

    retriever = ContextualCompressionRetriever(base_compressor=compressor, base_retriever=Fixed())
    return (
        {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()}
        | qa_prompt()
        | chat
        | StrOutputParser()
    )


def test_langchain_answers_over_orders_with_the_compressors_documents(smol):
    compressor = RagFixCompressor(strategy="lost-in-the-middle", backend=smol)
    plain = RagFixChatModel(smol, **ANSWER)
    _langchain_chain(compressor, plain).invoke(QUESTION)
    wrapped = marginalize_orders(smol, OrderOptions(orders=3))
    chat = RagFixChatModel(wrapped, passages_from=compressor, **ANSWER)
    answer = _langchain_chain(compressor, chat).invoke(QUESTION)
    chunks = [render_chunk(TITLES[i], CITY_TEXTS[i]) for i in (0, 2, 3, 1)]
    assert compressor.last_passages == chunks
    _check_votes(smol, chat, plain.last_prompt, chunks)
    assert answer == chat.last_generation.text
    # streamed through the same chain: the marginal answer, once (LangChain closes the stream
    # with an empty chunk)
    streamed = list(_langchain_chain(compressor, chat).stream(QUESTION))
    assert [s for s in streamed if s] == [answer]


def _haystack_pipeline(ranker, llm) -> Pipeline:
    pipe = Pipeline()
    pipe.add_component("ranker", ranker)
    pipe.add_component("prompt", qa_prompt_builder())
    pipe.add_component("llm", llm)
    pipe.connect("ranker.context", "prompt.context")
    pipe.connect("prompt.prompt", "llm.messages")
    return pipe


def _haystack_run(pipe: Pipeline, **llm_inputs) -> dict:
    docs = [
        HaystackDocument(content=t, meta={"title": TITLES[i]}, id=f"d{i}")
        for i, t in enumerate(CITY_TEXTS[:4])
    ]
    inputs = {"ranker": {"documents": docs, "query": QUESTION}, "prompt": {"query": QUESTION}}
    return pipe.run({**inputs, **({"llm": llm_inputs} if llm_inputs else {})})


def test_haystack_answers_over_orders_with_the_rankers_documents(smol):
    plain = RagFixChatGenerator(smol, **ANSWER)
    _haystack_run(_haystack_pipeline(RagFixRanker(strategy="none", backend=smol), plain))
    ranker = RagFixRanker(strategy="none", backend=smol)  # a component has one pipeline
    wrapped = marginalize_orders(smol, OrderOptions(orders=3))
    llm = RagFixChatGenerator(wrapped, passages_from=ranker, **ANSWER)
    pipe = _haystack_pipeline(ranker, llm)
    out = _haystack_run(pipe)
    chunks = [render_chunk(TITLES[i], CITY_TEXTS[i]) for i in range(4)]
    assert ranker.last_passages == chunks
    _check_votes(smol, llm, plain.last_prompt, chunks)
    assert out["llm"]["replies"][0].text == llm.last_generation.text
    # streamed: one piece, the marginal answer
    pieces: list[str] = []
    out = _haystack_run(pipe, streaming_callback=lambda c: pieces.append(c.content))
    assert pieces == [llm.last_generation.text] == [out["llm"]["replies"][0].text]
    # a component reference has no serialised form
    with pytest.raises(ConfigError, match="passages_from= cannot be serialised"):
        pipe.dumps()


def test_pine_answers_a_framework_prompt_with_the_documents_spans(tiny_qwen3, tiny_qwen3_dir):
    from ragfix.backends import load_backend

    pine = load_backend("pine", model=tiny_qwen3_dir, device="cpu")
    with pytest.raises(ConfigError, match="or give RagFixChatModel passages_from="):
        RagFixChatModel(pine, **ANSWER)
    compressor = RagFixCompressor(strategy="none", backend=tiny_qwen3)
    chat = RagFixChatModel(pine, passages_from=compressor, **ANSWER)
    answer = _langchain_chain(compressor, chat).invoke(QUESTION)
    chunks = [render_chunk(TITLES[i], CITY_TEXTS[i]) for i in range(4)]
    user = _user(chunks)
    assert chat.last_prompt == tiny_qwen3.format_prompt(TaskPrompt(user=user))
    prompt = TaskPrompt(
        user=user,
        passages=_spans_by_hand(user, chunks),
        passage_separator="\n\n",
        **ANSWER,
    )
    assert answer == pine.generate([prompt], batch_size=1)[0].text
    # the spans move the answer: the same prompt read as one passage answers otherwise
    span = (user.index(chunks[0]), user.index(chunks[-1]) + len(chunks[-1]))
    whole = TaskPrompt(user=user, passages=(span,), passage_separator="\n\n", **ANSWER)
    assert pine.generate([whole], batch_size=1)[0].text != answer


def test_refusals_are_one_line(smol):
    wrapped = marginalize_orders(smol, OrderOptions(orders=3))
    # without passages_from the wrapper is refused, as before
    for build in (RagFixLLM, RagFixChatModel, RagFixChatGenerator):
        with pytest.raises(ConfigError) as e:
            build(wrapped)
        assert "cannot run under a framework's LLM component" in str(e.value)
        assert "\n" not in str(e.value)
    post = RagFixPostprocessor(strategy="none", backend=smol)
    # settings checked when built
    for build in (RagFixLLM, RagFixChatModel):
        with pytest.raises(ConfigError, match="passages_from= needs use_chat_template=True"):
            build(wrapped, passages_from=post, use_chat_template=False)
    with pytest.raises(ConfigError, match="passages_from= needs use_chat_template=True"):
        RagFixChatGenerator({"name": "vanilla"}, passages_from=post, use_chat_template=False)
    with pytest.raises(ConfigError, match="not str"):
        RagFixLLM(wrapped, passages_from="post")
    llm = RagFixLLM(wrapped, passages_from=post, **ANSWER)
    # a source that has passed nothing on yet
    with pytest.raises(ConfigError, match="has passed no documents on yet"):
        llm.complete("Hello")
    # a document of the source missing from the prompt: named by index and first words
    post.postprocess_nodes(_nodes())
    chunks = [render_chunk(TITLES[i], CITY_TEXTS[i]) for i in range(4)]
    with pytest.raises(ConfigError) as e:
        llm.complete(_user([chunks[0], chunks[1], chunks[3]]))
    assert str(e.value) == (
        "RagFixLLM: document 2 of RagFixPostprocessor's last 4 ('Document (Title: City 2) "
        "Ottawa is the capital'...) is not in the prompt verbatim after the ones before "
        "it: render the documents as the component passes them on, in its order"
    )
    assert llm.calls == 0


def test_the_synthesizer_answers_concurrent_queries_each_over_its_own_chunks(tiny_qwen3):
    """``RagFixSynthesizer`` (issue 56): no state shared between queries. Two questions whose
    retriever returns different cities, asked at once (``asyncio.gather`` of two ``aquery`` on
    one engine with one postprocessor, over three orders of the passages): each answer is the
    wrapped backend's own answer to the task prompt of that question over its own chunks, the
    spans found by hand, and equals the answer asked alone."""
    import asyncio

    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever

    from ragfix import RagFixSynthesizer
    from ragfix.tasks import get_task

    questions = {
        "What is the capital of Germany?": [0, 1, 2],
        "Which city is Kenya's capital?": [4, 3, 1],
    }

    class ByQuestion(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [_nodes_of(i) for i in questions[query_bundle.query_str]]

    wrapped = marginalize_orders(tiny_qwen3, OrderOptions(orders=3))
    synth = RagFixSynthesizer(wrapped, max_new_tokens=8)
    post = RagFixPostprocessor(strategy="reverse", backend=tiny_qwen3)
    engine = RetrieverQueryEngine(
        retriever=ByQuestion(), response_synthesizer=synth, node_postprocessors=[post]
    )

    async def both():
        return await asyncio.gather(*(engine.aquery(q) for q in questions))

    together = [str(r.response) for r in asyncio.run(both())]
    alone = [str(engine.query(q).response) for q in questions]
    qa = get_task("qa")
    for (q, cities), answer, single in zip(questions.items(), together, alone, strict=True):
        chunks = [render_chunk(f"City {i}", CITY_TEXTS[i]) for i in reversed(cities)]
        user = qa.user_turn(q, join_chunks(chunks))
        prompt = TaskPrompt(user=user, passages=_spans_by_hand(user, chunks), max_new_tokens=8,
                            stop_at_newline=qa.stop_at_newline)  # fmt: skip
        [want] = wrapped.generate([prompt], batch_size=1)
        assert answer == single == want.text, q
    assert together[0] != together[1]  # each question's chunks give their own answer


def _nodes_of(i: int) -> NodeWithScore:
    return NodeWithScore(
        node=TextNode(
            text=CITY_TEXTS[i],
            id_=f"c{i}",
            metadata={"title": f"City {i}"},
            metadata_template="{value}",
            text_template="Document (Title: {metadata_str}) {content}",
        ),
        score=None,
    )
