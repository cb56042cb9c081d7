"""The pipeline sweep's LlamaIndex engine (:class:`LlamaIndexEngines`): per reorder strategy a
query engine of a retriever returning the cell's candidates,
:class:`~ragfix.postprocessor.RagFixPostprocessor` and ``compact`` response synthesis with
:class:`~ragfix.llm.RagFixLLM` (the LlamaIndex components users import from
:mod:`ragfix.postprocessor` and :mod:`ragfix.llm`). LlamaIndex is a core dependency: no extra.
"""

from __future__ import annotations

from ragfix.integrations.engine import PipelineEngines


def _fixed_retriever_class():
    from llama_index.core.retrievers import BaseRetriever

    class FixedRetriever(BaseRetriever):
        """Returns the node list it was last given (the permuted candidates of a cell)."""

        def __init__(self) -> None:
            super().__init__()
            self.nodes: list = []

        def _retrieve(self, query_bundle):
            return list(self.nodes)

    return FixedRetriever


class LlamaIndexEngines(PipelineEngines):
    """LlamaIndex: a query engine per strategy (a retriever returning the cell's candidates,
    :class:`~ragfix.postprocessor.RagFixPostprocessor`, ``compact`` synthesis with
    :class:`~ragfix.llm.RagFixLLM`, an LLM per strategy over the one backend)."""

    framework = "llamaindex"

    def _build(self, s: str, settings: dict) -> None:
        from llama_index.core import get_response_synthesizer
        from llama_index.core.indices.prompt_helper import PromptHelper
        from llama_index.core.query_engine import RetrieverQueryEngine

        from ragfix.llm import RagFixLLM
        from ragfix.postprocessor import RagFixPostprocessor, text_qa_template

        if not self.llms:
            self.fixed = _fixed_retriever_class()()
            self.engines: dict = {}
        self.posts[s] = RagFixPostprocessor(backend=self.backend, **settings)
        self.llms[s] = llm = RagFixLLM(self.backend, passages_from=self.source(s), **self.answer)
        helper = PromptHelper(
            context_window=llm.metadata.context_window,
            num_output=llm.metadata.num_output,
            tokenizer=self.backend.tokenize,
        )
        synth = get_response_synthesizer(
            llm=llm,
            response_mode="compact",
            text_qa_template=text_qa_template(self.task.name),
            prompt_helper=helper,
        )
        self.engines[s] = RetrieverQueryEngine(
            retriever=self.fixed, response_synthesizer=synth, node_postprocessors=[self.posts[s]]
        )

    def _order(self, s: str, cands: list) -> list[str]:
        return [n.node.node_id for n in self.posts[s].postprocess_nodes(cands)]

    def _query(self, s: str, question: str, cands: list) -> tuple[list[str], str]:
        self.fixed.nodes = cands
        resp = self.engines[s].query(question)
        return [n.node.node_id for n in resp.source_nodes], str(resp.response or "")
