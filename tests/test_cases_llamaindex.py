"""The LlamaIndex components on the failing cases of issue 13 (``tests/cases/``): 07 (LLM
settings against the real model), 08 (no, one and blank nodes), 25 (attention-sort without a
query). The case inputs are copied here so the tests run from a fresh clone."""

from __future__ import annotations

import pytest
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.prompts.prompt_utils import get_empty_prompt_txt
from llama_index.core.schema import NodeWithScore, TextNode

from ragfix.errors import ConfigError
from ragfix.llm import RagFixLLM
from ragfix.postprocessor import RagFixPostprocessor, text_qa_template
from ragfix.pruning import BudgetError, drop_blank, drop_near_duplicates
from ragfix.reorder import STRATEGIES, attention_sort_order
from ragfix.types import Passage


def _nodes(pairs) -> list[NodeWithScore]:
    return [
        NodeWithScore(node=TextNode(text=t, id_=f"n{i}"), score=s) for i, (t, s) in enumerate(pairs)
    ]


def _post(strategy: str, backend, **kw) -> RagFixPostprocessor:
    """A postprocessor of ``strategy`` (bias-profile with a 3-position profile)."""
    profile = [0.9, 0.1, 0.5] if strategy == "bias-profile" else None
    return RagFixPostprocessor(strategy=strategy, profile=profile, backend=backend, **kw)


# ---------------------------------------------------------------- case 07: RagFixLLM settings


@pytest.mark.parametrize("num_output", [2048, 4096])
def test_case07_output_budget_without_room_for_a_prompt_is_refused(smol, num_output):
    """Case 07, cases 1-2: num_output >= context_window fails at construction naming both."""
    with pytest.raises(ConfigError, match=f"num_output={num_output} .* context_window=2048"):
        RagFixLLM(smol, context_window=2048, num_output=num_output)
    # the chat template's own 30 tokens count: 2048 - 2030 = 18 tokens cannot hold it
    with pytest.raises(ConfigError, match="chat template alone takes 30 tokens"):
        RagFixLLM(smol, context_window=2048, num_output=2030)
    assert RagFixLLM(smol, context_window=2048, num_output=2017).metadata.num_output == 2017


def test_case07_context_window_comes_from_the_model(smol):
    """Case 07, case 3: no context_window given -> the model config's max_position_embeddings."""
    llm = RagFixLLM(smol, num_output=256)
    assert llm.metadata.context_window == smol.model.config.max_position_embeddings == 8192


def test_case07_larger_window_is_clamped_with_a_warning(smol):
    """Case 07, case 4: 1,000,000 is clamped to the model's 8192; metadata reports 8192."""
    with pytest.warns(UserWarning, match="context_window=1000000 .* clamped to 8192"):
        llm = RagFixLLM(smol, context_window=1_000_000, num_output=256)
    assert llm.metadata.context_window == 8192 and llm.context_window == 8192


def test_case07_metadata_and_prompt_helper(smol):
    """Case 07, case 5: metadata 2048 / 256; PromptHelper leaves 2048 - prompt - 256 > 0."""
    llm = RagFixLLM(smol, context_window=2048, num_output=256)
    meta = llm.metadata
    assert (meta.context_window, meta.num_output) == (2048, 256)
    template = text_qa_template()
    prompt_tokens = len(smol.tokenize(get_empty_prompt_txt(template)))
    helper = PromptHelper.from_llm_metadata(meta, tokenizer=smol.tokenize)
    available = helper.get_text_splitter_given_prompt(template, 1, padding=0).chunk_size
    assert available == 2048 - prompt_tokens - 256 > 0


# ---------------------------------------------------------------- case 08: 0, 1 and blank nodes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_case08_no_nodes_give_no_nodes(smol, strategy):
    """Case 08, case 1: [] -> [] for every strategy (bias-profile and attention-sort included)."""
    post = _post(strategy, smol)
    assert post.postprocess_nodes([], query_str="capital?") == []
    assert post.last_report["order"] == []
    assert post.last_report["dropped_blank"] == post.last_report["dropped_budget"] == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_case08_one_node_comes_back_unchanged(smol, strategy):
    """Case 08, case 2: a single node is returned as it came, whatever the strategy."""
    [node] = _nodes([("only node", 0.5)])
    post = _post(strategy, smol)
    out = post.postprocess_nodes([node], query_str="What is it?")
    assert len(out) == 1 and out[0] is node and out[0].score == 0.5
    assert post.last_report["order"] == [0]


@pytest.mark.parametrize("dedup", [0.9, None])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_case08_blank_nodes_are_dropped_and_reported(smol, strategy, dedup):
    """Case 08, case 3: "" and "   " are both dropped as blank (never one the duplicate of the
    other), with or without deduplication; tokens are counted on what remains."""
    nodes = _nodes([("", 0.9), ("   ", 0.8), ("real text", 0.7)])
    post = _post(strategy, smol, dedup_threshold=dedup)
    out = post.postprocess_nodes(nodes, query_str="What is real?")
    assert [n.node.node_id for n in out] == ["n2"]
    report = post.last_report
    assert report["dropped_blank"] == ["n0", "n1"]
    assert report["dropped_duplicates"] == report["dropped_budget"] == []
    # the corrections themselves: blanks are never duplicates of each other
    texts = ["", "   ", "real text"]
    assert drop_blank(texts) == [2] and drop_near_duplicates(texts) == [0, 1, 2]


LONG = "long node " * 400


def test_case08_budget_that_removes_every_node_is_never_silent(smol):
    """Case 08, case 4: a budget of 10 tokens cannot hold the only (800-token) node: an error by
    default, a warning and an empty list with ``over_budget="warn"``; never a silent []."""
    nodes = _nodes([(LONG, 0.9)])
    size = smol.count_tokens(LONG)
    post = RagFixPostprocessor(strategy="none", backend=smol, token_budget=10)
    with pytest.raises(BudgetError, match=f"best passage has {size} tokens but only 10 fit"):
        post.postprocess_nodes(nodes, query_str="q?")
    warn = RagFixPostprocessor(strategy="none", backend=smol, token_budget=10, over_budget="warn")
    with pytest.warns(UserWarning, match="only 10 fit .* no node is passed on"):
        assert warn.postprocess_nodes(nodes, query_str="q?") == []
    assert warn.last_report["dropped_budget"] == ["n0"]


# ---------------------------------------------------------------- case 25: attention-sort, no query

CASE25 = [
    ("Island ferry", "A ferry service to the island started in 1958, replacing the old mail boat."),
    (
        "Harbour lighthouse",
        "The harbour lighthouse was built from local granite and has a red copper roof.",
    ),
    ("Market hall", "The market hall clock was installed in 1902 and strikes every quarter hour."),
    (
        "Fishing fleet",
        "The fishing fleet once counted forty boats; today nine remain in the harbour.",
    ),
]
QUESTION25 = "In which year did the ferry service to the island start?"


def _case25_nodes() -> list[NodeWithScore]:
    return [
        NodeWithScore(node=TextNode(text=text, id_=f"n{i + 1}", metadata={"title": t}), score=s)
        for i, ((t, text), s) in enumerate(zip(CASE25, [0.83, 0.61, 0.55, 0.4], strict=True))
    ]


def test_case25_attention_sort_without_a_query_is_refused(smol, monkeypatch):
    """Case 25: no query (or a blank one) is a one-line ConfigError, before the model reads
    anything; with the question the four nodes come back permuted."""
    post = RagFixPostprocessor(
        strategy="attention-sort",
        attention_rounds=1,
        dedup_threshold=None,
        token_budget=2000,
        backend=smol,
    )
    reads: list = []
    import ragfix.backends.attention_sort.backend as scorer

    real = scorer.passage_attention
    monkeypatch.setattr(scorer, "passage_attention", lambda b, p: reads.append(p) or real(b, p))
    for kwargs in ({}, {"query_str": ""}, {"query_str": "   "}):
        with pytest.raises(ConfigError, match="attention-sort needs the query") as err:
            post.postprocess_nodes(_case25_nodes(), **kwargs)
        assert "\n" not in str(err.value)
    assert reads == []  # never sorted against an empty "Question: "
    out = post.postprocess_nodes(_case25_nodes(), query_str=QUESTION25)
    assert sorted(n.node.node_id for n in out) == ["n1", "n2", "n3", "n4"]
    assert len(reads) == 1 and QUESTION25 in reads[0].user
    passages = [Passage(title=t, text=x) for t, x in CASE25]
    with pytest.raises(ConfigError, match="needs the query"):
        attention_sort_order(smol, "", passages, rounds=1)
