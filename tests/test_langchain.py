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
