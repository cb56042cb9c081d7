"""``RagFixPostprocessor``: correct and reorder retrieved nodes before the LLM reads them.

Add it as the LAST node postprocessor of a LlamaIndex query engine (a reranker after it would undo
the order it sets)::

    from ragfix import RagFixLLM, RagFixPostprocessor, build_corpus
    from ragfix.backends import load_backend
    from ragfix.postprocessor import text_qa_template

    backend = load_backend("vanilla")                    # the embedded SmolLM2
    index = build_corpus("docs/").index                  # FAISS + the embedded MiniLM embedder
    post = RagFixPostprocessor(strategy="lost-in-the-middle", backend=backend)
    engine = index.as_query_engine(llm=RagFixLLM(backend), similarity_top_k=10,
                                   node_postprocessors=[post],
                                   text_qa_template=text_qa_template())

(``examples/quickstart.py`` runs this end to end.) ``text_qa_template()`` is the
Lost-in-the-Middle QA prompt of the ``qa`` task record (:mod:`ragfix.tasks`), the prompt the bias
profiles were measured with.

Steps, on the nodes in the order they arrive (that order is the retrieval rank; scores are not
needed): the correction of :mod:`ragfix.correction`, shared with the LangChain and Haystack
components:

1. correct: drop blank nodes (no word in their text, :func:`ragfix.pruning.drop_blank`), drop
   near-duplicate nodes (:func:`ragfix.pruning.drop_near_duplicates`), then fit the nodes to the
   backend's token budget, dropping the lowest-ranked whole nodes first
   (:func:`ragfix.pruning.fit_budget`; the best node is never cut: an error, or a warning and no
   nodes, instead);
2. reorder with the chosen strategy (:mod:`ragfix.reorder`).

What was dropped, and the order, are in :attr:`RagFixPostprocessor.last_report`, the nodes passed
on as the LLM reads them in :attr:`RagFixPostprocessor.last_passages` (what
``RagFixLLM(passages_from=post)`` finds in its prompt). No nodes give ``[]`` and a single node
comes back unchanged, whatever the strategy.
"""

from __future__ import annotations

from llama_index.core import PromptTemplate
from llama_index.core.bridge.pydantic import ConfigDict, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from ragfix.correction import Candidate, Correction, CorrectionFields
from ragfix.tasks import get_task


def text_qa_template(task: str = "qa") -> PromptTemplate:
    """The task record's user turn as a LlamaIndex text-QA prompt (``{context_str}``,
    ``{query_str}``), for ``text_qa_template=`` of a query engine or response synthesizer.

    Raises:
        ConfigError: unknown task.
    """
    return PromptTemplate(get_task(task).llama_index_template())


class RagFixPostprocessor(CorrectionFields, BaseNodePostprocessor):
    """Drop blank nodes and near-duplicates, fit the token budget, then reorder the nodes.

    Args:
        strategy, profile, profile_curve, num_docs, dedup_threshold, token_budget,
            reserve_tokens, over_budget, attention_rounds: the correction settings
            (:class:`ragfix.correction.CorrectionFields`, the same for every framework).
        backend: a :class:`ragfix.backends.Backend` (token counting, model identity,
            attention-sort); kept as a private attribute.

    Raises:
        ConfigError: (at construction) ``bias-profile`` without a profile, ``attention-sort`` or
            ``token_budget`` without a backend, a budget larger than the backend's window or
            ``reserve_tokens`` that leave none.
        pydantic.ValidationError (a ``ValueError``): an unknown setting (a typo is never ignored),
            an unknown strategy or a value out of range.
        ragfix.reorder.ProfileError: a profile of another model or number of documents.
        ragfix.pruning.BudgetError: (when run, ``over_budget="error"``) the best node alone
            exceeds the token budget.
    """

    model_config = ConfigDict(extra="forbid")

    _correction: Correction = PrivateAttr()

    def __init__(self, backend=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._correction = Correction(self, backend, noun="node")

    @classmethod
    def class_name(cls) -> str:
        return "RagFixPostprocessor"

    @property
    def last_report(self) -> dict:
        """What the last call did: ``dropped_blank``, ``dropped_duplicates`` and
        ``dropped_budget`` (node ids, in retrieval order; their lengths are the counts),
        ``order`` (rank at each prompt position, ranks of the kept nodes) and, for
        attention-sort, ``attention`` (per round, per kept rank)."""
        return self._correction.last_report

    @property
    def last_passages(self) -> list[str] | None:
        """The nodes the last call passed on, in prompt order, each as the LLM reads it
        (``get_content(metadata_mode=MetadataMode.LLM)``, what LlamaIndex's response synthesis
        puts into ``{context_str}``); ``None`` before the first call and after one that raised.
        What makes it a :class:`ragfix.answering.PassageSource` for
        ``RagFixLLM(passages_from=...)``."""
        return self._correction.last_passages

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        candidates = [
            Candidate(
                id=n.node.node_id,
                text=n.node.get_content(metadata_mode=MetadataMode.LLM),
                content=n.node.get_content(metadata_mode=MetadataMode.NONE),
                title=str(n.node.metadata.get("title", "")),
            )
            for n in nodes
        ]
        query = query_bundle.query_str if query_bundle is not None else None
        return [nodes[i] for i in self._correction.apply(candidates, query)]
