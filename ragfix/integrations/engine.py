"""What the three framework engines of the pipeline sweep share (:class:`PipelineEngines`): a
pipeline per reorder strategy over a backend, fed the candidates of one cell, answering it and
building its record.

Each framework's engine lives beside its components: :class:`~ragfix.integrations.llama_index.
LlamaIndexEngines` (:class:`~ragfix.postprocessor.RagFixPostprocessor`, :class:`~ragfix.llm.
RagFixLLM`), :class:`~ragfix.integrations.langchain.LangChainEngines` and
:class:`~ragfix.integrations.haystack.HaystackEngines`. The candidates are LlamaIndex
``NodeWithScore`` (the sweep's retriever is LlamaIndex's); the other frameworks get them as their
own document type (:func:`node_parts`). The same cell gives the same prompt text in every
framework (the record's ``prompt_sha1``). The sweep itself is
:func:`ragfix.eval.pipeline.run_pipeline_sweep`.
"""

from __future__ import annotations

import hashlib
import time

from ragfix.backends.base import Fit
from ragfix.metrics import cell_flags
from ragfix.prompts import TaskPrompt, find_passages
from ragfix.reorder import ATTENTION_STRATEGIES
from ragfix.tasks import get_task, join_chunks
from ragfix.types import OVERFLOW, UNSCORED, StoredPrompt, SweepRecord, generation_extra


def candidates_with_gold_at(retrieved: list, gold, rank: int) -> list:
    """The retrieved ``NodeWithScore`` list with the gold node moved to 0-based ``rank``.

    The other nodes keep their retrieval order; the scores of ``retrieved`` (sorted descending,
    ``None`` kept) are reassigned by list position so the order and the scores agree.
    """
    from llama_index.core.schema import NodeWithScore

    others = [n for n in retrieved if n.node.node_id != gold.node.node_id]
    others = others[: len(retrieved) - 1]
    order = [*others[:rank], gold, *others[rank:]]
    scores = [n.score for n in retrieved]
    if all(s is not None for s in scores):
        scores = sorted(scores, reverse=True)
    return [NodeWithScore(node=n.node, score=s) for n, s in zip(order, scores, strict=True)]


def node_text(node) -> str:
    """A candidate node as the LLM reads it (``Document (Title: t) text``)."""
    from llama_index.core.schema import MetadataMode

    return node.node.get_content(metadata_mode=MetadataMode.LLM)


def _read_prompt(text: str, chunks: list[str], ids: list[str], q) -> StoredPrompt:
    """The prompt a pipeline's model read (``text``, as its LLM component sent it) with the
    spans of the ``chunks`` it holds verbatim (:func:`ragfix.prompts.find_passages`: in prompt
    order, each searched after the one before; a chunk the framework rewrote has no span) and
    the gold chunk's index among them (None when it is not among them)."""
    spans, gold = [], None
    for span, node_id in zip(find_passages(text, chunks), ids, strict=True):
        if span is None:
            continue
        if node_id == q.gold_node_id:
            gold = len(spans)
        spans.append(span)
    return StoredPrompt(text=text, passages=spans, gold=gold)


def node_parts(node) -> tuple[str, str, str, float | None]:
    """``(id, title, bare text, score)`` of a candidate node, for another framework's
    document type."""
    from llama_index.core.schema import MetadataMode

    content = node.node.get_content(metadata_mode=MetadataMode.NONE)
    return node.node.node_id, str(node.node.metadata.get("title", "")), content, node.score


class PipelineEngines:
    """One pipeline per strategy in a framework, over a backend and a retriever that returns the
    cell's candidates (the ``task``'s prompt, all kept chunks in one prompt); :meth:`run`
    answers one cell and builds its record. Subclasses build the framework's pipelines
    (:meth:`_build`), run the correction alone (:meth:`_order`) and query a pipeline
    (:meth:`_query`); ``self.llms[s]`` is strategy ``s``'s LLM component (``calls``,
    ``last_prompt``, ``last_generation``) and ``self.posts[s]`` its correction component
    (``last_report``).

    Args:
        backend: the answering :class:`~ragfix.backends.Backend`: one that reads plain prompts,
            or order marginalization over one (:mod:`ragfix.backends.orders`), whose LLM
            components are then given their correction component as ``passages_from``
            (:meth:`source`).
        strategies: the reorder strategies, one pipeline each (:mod:`ragfix.reorder`).
        accuracies: the bias profile's accuracy per position (``bias-profile``), or ``None``.
        top_k: the chunks of each cell (the retriever's top-k).
        attention_rounds: rounds of the attention strategies.
        task: the QA task whose prompt every framework's pipeline renders, whose answer budget
            and stop rule its LLM component follows and whose scorer scores the answer
            (:mod:`ragfix.tasks`: ``qa``, ``qa-extractive``, a repeated variant).

    A cell is ``(question, rank, strategy, cell id)``; the question has ``id``, ``question``,
    ``answers`` and ``gold_node_id`` (:class:`~ragfix.connectors.corpus.PipelineQuestion`).
    """

    framework = ""

    def __init__(
        self,
        backend,
        strategies,
        accuracies,
        top_k: int,
        attention_rounds: int,
        task: str = "qa",
    ):
        self.backend, self.top_k, self.task = backend, top_k, get_task(task)
        self.fit: dict[str, Fit] = {}  # cell id -> the backend's verdict on its prompt
        self.answer = {
            "max_new_tokens": self.task.max_new_tokens,
            "stop_at_newline": self.task.stop_at_newline,
            "prefix_reuse": True,
        }
        self.llms: dict = {}
        self.posts: dict = {}
        for s in strategies:
            self._build(
                s,
                {
                    "strategy": s,
                    "profile": accuracies if s == "bias-profile" else None,
                    "num_docs": top_k if s == "bias-profile" else None,
                    "dedup_threshold": None,  # every strategy reads the same k chunks
                    "attention_rounds": attention_rounds,
                    "attention_task": self.task.once.name,
                },
            )

    def source(self, s: str):
        """The ``passages_from`` of strategy ``s``'s LLM component: its correction component
        when the backend needs to know where the passages are
        (:attr:`~ragfix.backends.Backend.needs_passage_spans`: order marginalization), else
        ``None`` (plain text)."""
        return self.posts[s] if self.backend.needs_passage_spans else None

    def _build(self, s: str, settings: dict) -> None:
        """Build strategy ``s``'s pipeline, its correction component made with ``settings``."""
        raise NotImplementedError

    def _order(self, s: str, cands: list) -> list[str]:
        """Node ids of ``cands`` after strategy ``s``'s correction alone."""
        raise NotImplementedError

    def _query(self, s: str, question: str, cands: list) -> tuple[list[str], str]:
        """Strategy ``s``'s pipeline on ``question`` with ``cands`` retrieved: the node ids the
        LLM read, in prompt order, and the answer."""
        raise NotImplementedError

    def plan(self, todo: list, retrieved: dict, by_id: dict) -> list[tuple[list, tuple]]:
        """``(candidates, cell)`` for every cell, in run order: per question, static strategies
        sorted by their final node order (neighbours share long prompt prefixes, which the
        LLM's KV-cache reuse exploits), attention-sort last, cells that overflow the window
        (:meth:`fits`, computed here once per cell) first (they run nothing)."""
        from llama_index.core.schema import NodeWithScore

        keyed = []
        for cell in todo:
            q, r, s, _ = cell
            res, _nat = retrieved[q.id]
            gold = next((n for n in res if n.node.node_id == q.gold_node_id), None)
            if gold is None:
                gold = NodeWithScore(node=by_id[q.gold_node_id], score=None)
            cands = candidates_with_gold_at(res, gold, r)
            self.fit[cell[3]] = self.fits(q.question, cands)
            if not self.fit[cell[3]].runs:
                key = (q.id, -1, [n.node.node_id for n in cands])
            elif s in ATTENTION_STRATEGIES:
                key = (q.id, 1, [n.node.node_id for n in cands])
            else:
                key = (q.id, 0, self._order(s, cands))
            keyed.append((key, cands, cell))
        keyed.sort(key=lambda x: x[0])
        return [(cands, cell) for _key, cands, cell in keyed]

    def run(self, q, r: int, s: str, cell: str, cands: list, natural: int | None) -> SweepRecord:
        """Query strategy ``s``'s pipeline with ``cands`` as the retrieved nodes; the record of
        cell ``cell`` (gold at retrieval rank ``r``), with the prompt the model read
        (:func:`_read_prompt`) and its SHA-1 (``prompt_sha1``: the same cell gives the same
        prompt in every framework). When the
        candidates do not fit the window in one prompt (:meth:`fits`) nothing runs: the record is
        flagged ``overflow`` (a backend that cuts long prompts by design runs it, flagged
        ``cut_to_window``)."""
        fit = self.fit.get(cell) or self.fits(q.question, cands)
        if not fit.runs:
            return self._overflow(q, r, s, cell, fit.prompt_tokens, natural)
        llm = self.llms[s]
        calls = llm.calls
        start = time.perf_counter()
        final_ids, answer = self._query(s, q.question, cands)
        secs = time.perf_counter() - start
        by_id = {n.node.node_id: n for n in cands}
        seen = llm.last_prompt or ""
        prompt = " ".join(seen.split())  # white space may change
        cut = any(" ".join(node_text(by_id[i]).split()) not in prompt for i in final_ids)
        gen = llm.last_generation
        rep = self.posts[s].last_report
        flags, explained = cell_flags(q.answers, [*([fit.flag] if fit.flag else []), *gen.flags])
        explained.update(generation_extra(gen))
        return SweepRecord(
            cell_id=cell,
            sample_id=q.id,
            position=r,
            prompt_position=final_ids.index(q.gold_node_id) if q.gold_node_id in final_ids else -1,
            num_docs=self.top_k,
            backend=self.backend.name,
            strategy=s,
            prompt_tokens=gen.prompt_tokens,
            prefill_tokens=gen.prefill_tokens,
            new_tokens=gen.new_tokens,
            answer=answer,
            correct=not UNSCORED.intersection(flags) and self.task.score(answer, q.answers),
            seconds=round(secs, 4),
            flags=flags,
            question=q.question,
            gold_answers=q.answers,
            prompt=_read_prompt(seen, [node_text(by_id[i]) for i in final_ids], final_ids, q),
            extra={
                **explained,
                "framework": self.framework,
                "gold_added": natural is None,
                "natural_rank": natural,
                "context_cut": cut,
                "llm_calls": llm.calls - calls,
                "prompt_sha1": hashlib.sha1(seen.encode()).hexdigest(),
                "dropped": len(rep.get("dropped_duplicates", []))
                + len(rep.get("dropped_budget", [])),
                "order": rep.get("order"),
            },
        )

    def fits(self, question: str, cands: list) -> Fit:
        """The backend's verdict (:meth:`~ragfix.backends.Backend.fit`) on the task's prompt
        with every candidate chunk (as every framework renders them, in candidate order, their
        spans known: a backend over several orders of them judges the longest) and the answer
        budget."""
        chunks = [node_text(n) for n in cands]
        user = self.task.user_turn(question, join_chunks(chunks))
        spans = tuple(span for span in find_passages(user, chunks) if span is not None)
        prompt = TaskPrompt(user=user, max_new_tokens=self.answer["max_new_tokens"], passages=spans)
        return self.backend.fit(prompt)

    def _overflow(self, q, r: int, s: str, cell: str, n: int, natural: int | None) -> SweepRecord:
        """The record of a cell that was not run: its prompt of ``n`` tokens does not fit."""
        flags, explained = cell_flags(q.answers, [OVERFLOW])
        return SweepRecord(
            cell_id=cell,
            sample_id=q.id,
            position=r,
            prompt_position=-1,
            num_docs=self.top_k,
            backend=self.backend.name,
            strategy=s,
            prompt_tokens=n,
            prefill_tokens=0,
            new_tokens=0,
            answer="",
            correct=False,
            seconds=0.0,
            flags=flags,
            question=q.question,
            gold_answers=q.answers,
            extra={
                **explained,
                "framework": self.framework,
                "gold_added": natural is None,
                "natural_rank": natural,
            },
        )
