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
needed):

1. correct: drop blank nodes (no word in their text, :func:`ragfix.correct.drop_blank`), drop
   near-duplicate nodes (:func:`ragfix.correct.drop_near_duplicates`), then fit the nodes to the
   backend's token budget, dropping the lowest-ranked whole nodes first
   (:func:`ragfix.correct.fit_budget`; the best node is never cut: an error, or a warning and no
   nodes, instead);
2. reorder with the chosen strategy (:mod:`ragfix.reorder`).

What was dropped, and the order, are in :attr:`RagFixPostprocessor.last_report`. No nodes give
``[]`` and a single node comes back unchanged, whatever the strategy.
"""

from __future__ import annotations

import warnings
from typing import Literal

from llama_index.core import PromptTemplate
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, field_validator
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from ragfix.correct import BudgetError, drop_blank, drop_near_duplicates, fit_budget
from ragfix.errors import ConfigError
from ragfix.reorder import (
    STRATEGIES,
    ProfileError,
    attention_sort_order,
    check_strategy,
    load_profile,
    static_order,
)
from ragfix.tasks import get_task
from ragfix.types import Passage


def text_qa_template(task: str = "qa") -> PromptTemplate:
    """The task record's user turn as a LlamaIndex text-QA prompt (``{context_str}``,
    ``{query_str}``), for ``text_qa_template=`` of a query engine or response synthesizer.

    Raises:
        ConfigError: unknown task.
    """
    return PromptTemplate(get_task(task).llama_index_template())


class RagFixPostprocessor(BaseNodePostprocessor):
    """Drop blank nodes and near-duplicates, fit the token budget, then reorder the nodes.

    Args:
        strategy: one of ``none``, ``lost-in-the-middle``, ``reverse``, ``bias-profile``,
            ``attention-sort`` (see :mod:`ragfix.reorder`).
        profile: for ``bias-profile``: a sweep's ``summary.json`` path or a list of accuracies per
            prompt position; it is checked against the backend's model and ``num_docs``.
        profile_curve: which curve of the summary to use when it holds several.
        num_docs: the number of nodes the profile must cover (checked when set; otherwise the
            profile's length must equal the number of nodes that reach the reorder step).
        dedup_threshold: word-3-gram Jaccard similarity at which a node counts as a duplicate of a
            higher-ranked one (``None`` keeps duplicates).
        token_budget: tokens the nodes may take (at most the backend's context window); default:
            the backend's context window minus ``reserve_tokens`` (``None`` without a backend: no
            budget fitting).
        reserve_tokens: tokens kept for the template, the question and the answer.
        over_budget: when the best node alone exceeds the budget: ``error`` raises
            :class:`~ragfix.correct.BudgetError`, ``warn`` warns and passes no nodes on.
        attention_rounds: sorting rounds of ``attention-sort``.
        backend: a :class:`ragfix.backends.Backend` (token counting, model identity,
            attention-sort); kept as a private attribute.

    Raises:
        ConfigError: (at construction) ``bias-profile`` without a profile, ``attention-sort`` or
            ``token_budget`` without a backend, a budget larger than the backend's window or
            ``reserve_tokens`` that leave none; (when run) ``attention-sort`` without a query.
        pydantic.ValidationError (a ``ValueError``): an unknown setting (a typo is never ignored),
            an unknown strategy or a value out of range.
        ragfix.reorder.ProfileError: a profile of another model or number of documents.
        ragfix.correct.BudgetError: (when run, ``over_budget="error"``) the best node alone
            exceeds the token budget.
    """

    model_config = ConfigDict(extra="forbid")

    strategy: str = Field(default="lost-in-the-middle", description=", ".join(STRATEGIES))
    profile: str | list[float] | None = Field(default=None, description="bias-profile source")
    profile_curve: str | None = Field(default=None, description="curve label in summary.json")
    num_docs: int | None = Field(default=None, gt=0, description="nodes the profile must cover")
    dedup_threshold: float | None = Field(default=0.9, gt=0, le=1)
    token_budget: int | None = Field(default=None, gt=0)
    reserve_tokens: int = Field(default=512, ge=0)
    over_budget: Literal["error", "warn"] = Field(default="error")
    attention_rounds: int = Field(default=2, ge=1)

    _backend = PrivateAttr(default=None)
    _accuracies: list[float] | None = PrivateAttr(default=None)
    _last_report: dict = PrivateAttr(default_factory=dict)

    def __init__(self, backend=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._backend = backend
        if self.strategy == "bias-profile":
            if self.profile is None:
                raise ConfigError("strategy 'bias-profile' needs profile= (summary.json path)")
            model = backend.model_name if backend is not None else None
            self._accuracies = load_profile(self.profile, model, self.num_docs, self.profile_curve)
        if self.strategy == "attention-sort" and backend is None:
            raise ConfigError("strategy 'attention-sort' needs backend= (it reads the attention)")
        if backend is None:
            if self.token_budget is not None:
                raise ConfigError("token_budget needs backend= to count tokens")
            return
        window = backend.context_window
        if self.token_budget is not None and self.token_budget > window:
            raise ConfigError(
                f"token_budget={self.token_budget} is larger than the {window}-token window of "
                f"{backend.model_name}"
            )
        if self.token_budget is None and window - self.reserve_tokens <= 0:
            raise ConfigError(
                f"reserve_tokens={self.reserve_tokens} leaves no token budget in the "
                f"{window}-token window of {backend.model_name}"
            )

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        return check_strategy(v)

    @classmethod
    def class_name(cls) -> str:
        return "RagFixPostprocessor"

    @property
    def last_report(self) -> dict:
        """What the last call did: ``dropped_blank``, ``dropped_duplicates`` and
        ``dropped_budget`` (node ids, in retrieval order; their lengths are the counts),
        ``order`` (rank at each prompt position, ranks of the kept nodes) and, for
        attention-sort, ``attention`` (per round, per kept rank)."""
        return self._last_report

    def _budget(self) -> int | None:
        if self.token_budget is not None:
            return self.token_budget
        if self._backend is None:
            return None
        return self._backend.context_window - self.reserve_tokens

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        def ids(dropped) -> list[str]:
            return [nodes[i].node.node_id for i in sorted(dropped)]

        report: dict = {"dropped_blank": [], "dropped_duplicates": [], "dropped_budget": []}
        self._last_report = report
        keep = drop_blank([n.node.get_content(metadata_mode=MetadataMode.NONE) for n in nodes])
        report["dropped_blank"] = ids(set(range(len(nodes))) - set(keep))
        texts = [nodes[i].node.get_content(metadata_mode=MetadataMode.LLM) for i in keep]
        if self.dedup_threshold is not None:
            unique = drop_near_duplicates(texts, self.dedup_threshold)
            report["dropped_duplicates"] = ids(keep[j] for j in set(range(len(keep))) - set(unique))
            keep, texts = [keep[j] for j in unique], [texts[j] for j in unique]
        budget = self._budget()
        if budget is not None and keep:
            try:
                fit = fit_budget(texts, budget, self._backend.count_tokens)
            except BudgetError as e:
                if self.over_budget == "error":
                    raise
                warnings.warn(f"{e}; no node is passed on", UserWarning, stacklevel=2)
                fit = []
            report["dropped_budget"] = ids(keep[len(fit) :])
            keep = [keep[j] for j in fit]
        kept = [nodes[i] for i in keep]
        if self.strategy == "attention-sort":
            query = query_bundle.query_str if query_bundle is not None else ""
            passages = [
                Passage(
                    title=str(n.node.metadata.get("title", "")),
                    text=n.node.get_content(metadata_mode=MetadataMode.NONE),
                )
                for n in kept
            ]
            order, attention = attention_sort_order(
                self._backend, query, passages, self.attention_rounds
            )
            report["attention"] = attention
        else:
            try:
                order = static_order(self.strategy, len(kept), self._accuracies)
            except ProfileError as e:
                dropped = [f"{len(v)} {k[8:]}" for k, v in report.items() if v]
                hint = ", set dedup_threshold=None" if report["dropped_duplicates"] else ""
                raise ProfileError(
                    f"{e} ({len(nodes)} nodes given, dropped: {', '.join(dropped) or 'none'}{hint})"
                ) from None
        report["order"] = order
        return [kept[r] for r in order]
