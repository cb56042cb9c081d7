"""The LangChain integration in a real chain: a FAISS vector store over the embedded MiniLM,
``ContextualCompressionRetriever`` with ``RagFixCompressor``, the ``qa`` prompt and
``RagFixChatModel`` over the real SmolLM2. Placement and budget fitting are read off the prompt
the model actually received."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import CITY_TEXTS
from langchain_classic.retrievers import ContextualCompressionRetriever
from langchain_community.vectorstores import FAISS
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from pydantic import ValidationError

from ragfix.errors import ConfigError
from ragfix.integrations.langchain import (
    RagFixChatModel,
    RagFixCompressor,
    embeddings,
    format_documents,
    qa_prompt,
)
from ragfix.postprocessor import text_qa_template
from ragfix.prompts import TaskPrompt
from ragfix.pruning import BudgetError
from ragfix.reorder import ProfileError

QUESTION = "What is the capital of Germany?"


@pytest.fixture(scope="module")
def store():
    docs = [
        Document(page_content=t, metadata={"title": f"City {i}"}, id=f"d{i}")
        for i, t in enumerate(CITY_TEXTS)
    ]
    return FAISS.from_documents(docs, embeddings())


def _chain(retriever, chat):
    return (
        {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()}
        | qa_prompt()
        | chat
        | StrOutputParser()
    )


def _where(prompt: str, docs: list[Document]) -> list[int]:
    return [prompt.index(f"Document (Title: {d.metadata['title']}) {d.page_content}") for d in docs]


def test_chain_reads_the_documents_in_strategy_order(store, smol):
    base = store.as_retriever(search_kwargs={"k": 4})
    retrieved = base.invoke(QUESTION)
    assert retrieved[0].id == "d0"  # the embedder finds Berlin
    chat = RagFixChatModel(smol, max_new_tokens=8, stop_at_newline=True)
    comp = RagFixCompressor(strategy="reverse", backend=smol)
    retriever = ContextualCompressionRetriever(base_compressor=comp, base_retriever=base)
    answer = _chain(retriever, chat).invoke(QUESTION)
    assert chat.calls == 1 and answer == chat.last_generation.text
    where = _where(chat.last_prompt, list(reversed(retrieved)))
    assert where == sorted(where)  # the model read them best last
    assert comp.last_report["order"] == [3, 2, 1, 0]
    # the same user turn LlamaIndex builds from the same chunks
    context = format_documents(retrieved[::-1])
    user = text_qa_template().format(context_str=context, query_str=QUESTION)
    assert chat.last_prompt == smol.format_prompt(TaskPrompt(user=user))
    assert chat.last_prompt.startswith("<|im_start|>system")


def test_budget_and_duplicates_are_fitted_on_the_prompt_the_model_gets(store, smol):
    docs = store.as_retriever(search_kwargs={"k": 4}).invoke(QUESTION)
    docs.insert(1, Document(page_content=docs[0].page_content, metadata=docs[0].metadata, id="dup"))
    sizes = [smol.count_tokens(format_documents([d])) for d in docs]
    budget = sizes[0] + sizes[2] + sizes[3]  # the best, then two more (the copy is dropped)
    comp = RagFixCompressor(strategy="lost-in-the-middle", backend=smol, token_budget=budget)
    kept = comp.compress_documents(docs, QUESTION)
    assert comp.last_report["dropped_duplicates"] == ["dup"]
    assert comp.last_report["dropped_budget"] == [docs[4].id]
    assert [d.id for d in kept] == [docs[0].id, docs[3].id, docs[2].id]
    chat = RagFixChatModel(smol, max_new_tokens=4)
    chat.invoke(qa_prompt().invoke({"context": format_documents(kept), "question": QUESTION}))
    where = _where(chat.last_prompt, kept)
    assert where == sorted(where) and docs[4].page_content not in chat.last_prompt
    # the same compressor as a document transformer (in place of LongContextReorder)
    assert [d.id for d in comp.transform_documents(docs)] == [d.id for d in kept]
    tight = RagFixCompressor(strategy="none", backend=smol, token_budget=sizes[0] - 1)
    with pytest.raises(BudgetError, match="best passage"):
        tight.compress_documents(docs, QUESTION)


def test_settings_are_validated_when_built(smol):
    with pytest.raises(ValidationError, match="dedup_treshold"):
        RagFixCompressor(strategy="none", dedup_treshold=0.5)
    with pytest.raises(ValidationError, match="unknown reorder strategy"):
        RagFixCompressor(strategy="random")
    with pytest.raises(ConfigError, match="token_budget=9000 is larger than the 8192-token"):
        RagFixCompressor(backend=smol, token_budget=9000)
    with pytest.raises(ConfigError, match="needs backend"):
        RagFixCompressor(strategy="attention-sort")
    with pytest.raises(ProfileError, match="covers 3 documents but 4"):
        RagFixCompressor(strategy="bias-profile", profile=[0.9, 0.1, 0.5]).compress_documents(
            [Document(page_content=t) for t in CITY_TEXTS[:4]], QUESTION
        )
    with pytest.raises(ValidationError, match="max_new_token\n"):
        RagFixChatModel(smol, max_new_token=5)
    with pytest.raises(ConfigError, match="num_output=8192 leaves no room"):
        RagFixChatModel(smol, max_new_tokens=8192)


def test_chat_model_streams_and_refuses_other_turns(smol):
    chat = RagFixChatModel(smol, max_new_tokens=12, stop_at_newline=True)
    prompt = "What is the capital of France? Answer in one sentence."
    full = chat.invoke(prompt).content
    pieces = [c.content for c in chat.stream(prompt)]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == full and "Paris" in full
    assert chat.invoke(prompt, stop=["capital"]).content == full[: full.index("capital")]
    with pytest.raises(ConfigError, match="one user turn .* SystemMessage, HumanMessage"):
        chat.invoke([SystemMessage("Be brief."), HumanMessage(prompt)])


@pytest.mark.processes
def test_core_import_stays_light_and_a_missing_extra_is_one_line():
    code = (
        "import sys, ragfix, ragfix.correction, ragfix.answering, ragfix.integrations; "
        "assert 'langchain_core' not in sys.modules and 'haystack' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    code = (
        "import sys; sys.modules['langchain_classic'] = None; import ragfix.integrations.langchain"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1] == (
        "ragfix.errors.MissingExtraError: the langchain integration needs langchain_classic: "
        'pip install "ragfix[langchain]"'
    )


# ------------------------------------------------------------------ turn-3 cases

Q = "What is the capital of France?"
#: the case's stop strings, each spanning streamed pieces of the answer
CASE_STOPS = ([" capital of"], ["France is"], ["Paris"], ["is Paris"])


def test_c2_stream_holds_back_a_stop_string_spanning_two_pieces(smol):
    """C2 (vllm-project/vllm#3574): ``stream(Q, stop=[" capital of"])`` gave ``'The capital'``
    where ``invoke`` gave ``'The'``. Streaming now holds back text that may begin a stop string:
    for every stop of the case ``stream`` gives ``invoke``'s text, which is the answer cut before
    the stop, and no streamed piece holds any part of the stop."""
    chat = RagFixChatModel(smol, max_new_tokens=24)
    full = chat.invoke(Q).content
    assert full == "The capital of France is Paris."
    assert [c.content for c in chat.stream(Q) if c.content][:3] == ["The", " capital", " of"]
    for stop in CASE_STOPS:
        pieces = [c.content for c in chat.stream(Q, stop=stop) if c.content]
        assert "".join(pieces) == chat.invoke(Q, stop=stop).content == full[: full.find(stop[0])]
    assert [c.content for c in chat.stream(Q, stop=[" capital of"]) if c.content] == ["The"]


def test_c2_every_split_of_the_stream_cuts_as_the_whole_text_does():
    """C2, the rule on its own (:class:`ragfix.answering.StopStream`): every way of cutting an
    answer into pieces, and overlapping stop strings (a longer one starting before a shorter
    one that completes first), give :func:`~ragfix.answering.cut_at_stop` of the whole."""
    import itertools

    from ragfix.answering import StopStream, cut_at_stop

    text = "The capital of France is Paris."
    cases = [*CASE_STOPS, ["capital of France", "of"], ["is Paris.", "s"], ["xyz"], []]
    for stops in cases:
        for cuts in itertools.combinations(range(1, len(text)), 3):
            pieces = [text[i:j] for i, j in zip((0, *cuts), (*cuts, len(text)), strict=True)]
            cutter, out = StopStream(stops), ""
            for piece in pieces:
                out += cutter.feed(piece)
                assert cut_at_stop(text, stops).startswith(out)  # never emitted, then cut
            out += cutter.close()
            assert out == cut_at_stop(text, stops), (stops, pieces)


def test_c2_a_served_model_streams_the_same_text_as_it_answers():
    """C2 through a stand-in server on 127.0.0.1 that streams the answer in fixed pieces: the
    remote backend under ``RagFixChatModel``; ``stream`` equals ``invoke`` for every stop."""
    from fake_openai import FakeOpenAI

    from ragfix.backends import load_backend

    pieces = ["The", " capital", " of", " France", " is", " Paris", "."]
    with FakeOpenAI(pieces=pieces) as fake:
        remote = load_backend(
            "vanilla", model="openai:fake", api_base=fake.url, tokenizer="smollm2"
        )
        chat = RagFixChatModel(remote, max_new_tokens=24)
        assert chat.invoke(Q).content == "".join(pieces)
        for stop in (*CASE_STOPS, ["capital of France"], ["ca"]):
            streamed = "".join(c.content for c in chat.stream(Q, stop=stop))
            assert streamed == chat.invoke(Q, stop=stop).content
        assert [c.content for c in chat.stream(Q, stop=["France is"]) if c.content] == [
            "The",
            " capital",
            " of",
            " ",
        ]


def test_c23b_per_call_settings_are_honoured_and_other_blocks_refused(smol):
    """C23b (langchain-ai/langchain PR#32441): ``invoke(Q, max_tokens=3)`` and
    ``bind(max_tokens=3)`` were ignored and an image block next to the text was dropped
    silently. Now the per-call budget is the answer's (streamed too), other per-call keywords
    and blocks that are not text are refused in one line, text blocks are read joined as
    ``ragfix serve`` joins text parts, and the token counts are in ``usage_metadata``."""
    from ragfix.serve import Message

    chat = RagFixChatModel(smol, max_new_tokens=24)
    whole = chat.invoke(Q)
    gen = chat.last_generation
    assert whole.usage_metadata == {
        "input_tokens": gen.prompt_tokens,
        "output_tokens": gen.new_tokens,
        "total_tokens": gen.prompt_tokens + gen.new_tokens,
    }
    assert gen.new_tokens > 3 and gen.prompt_tokens == smol.count_tokens(chat.last_prompt)
    three = chat.invoke(Q, max_tokens=3)
    assert chat.last_generation.new_tokens == 3 == three.usage_metadata["output_tokens"]
    assert three.content == "The capital of" and whole.content.startswith(three.content)
    assert chat.bind(max_tokens=3).invoke(Q).content == three.content
    assert chat.invoke(Q, max_new_tokens=3).content == three.content
    assert "".join(c.content for c in chat.bind(max_tokens=3).stream(Q)) == three.content
    assert chat.invoke(Q).content == whole.content  # the model's own setting is unchanged
    with pytest.raises(ConfigError, match=r"^RagFixChatModel does not take temperature per call"):
        chat.invoke(Q, temperature=0.7)
    with pytest.raises(ConfigError, match=r"^RagFixChatModel: max_new_tokens=0: .*greater than 0"):
        chat.invoke(Q, max_tokens=0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ConfigError, match="content block 1 of the HumanMessage is 'image_url'"):
        chat.invoke([HumanMessage(content=[{"type": "text", "text": Q}, image])])
    parts = [
        {"type": "text", "text": "What is the capital"},
        {"type": "text", "text": " of France?"},
    ]
    assert chat.invoke([HumanMessage(content=parts)]).content == whole.content
    assert Message(role="user", content=parts).text() == Q  # the served endpoint's rule
