"""The judge as a LlamaIndex evaluator (built on first use: importing :mod:`ragfix.judge` does not
import LlamaIndex)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from ragfix.errors import ConfigError, RagfixError
from ragfix.judge.judge import PairwiseJudge
from ragfix.judge.verdicts import PairJudgment
from ragfix.types import OVERFLOW


def _result(res: PairJudgment, verdict: str, query: str, response: str, contexts):
    """The ``EvaluationResult`` of a judged pair for the chosen order-free ``verdict``."""
    from llama_index.core.evaluation import EvaluationResult
    from llama_index.core.evaluation.pairwise import EvaluationSource

    if OVERFLOW in res.flags:
        return EvaluationResult(
            query=query,
            response=response,
            feedback="not judged: the judge prompt does not fit the model's window",
            invalid_result=True,
            invalid_reason="the judge prompt plus its answer budget exceeds the context window",
        )
    v = res.logit_verdict if verdict == "logit" else res.swap_verdict
    feedback = (
        f"original order: {res.original.raw!r} -> {res.verdict_original}; "
        f"swapped order: {res.swapped.raw!r} -> {res.verdict_swapped}; "
        f"{verdict} verdict: {v}"
    )
    if v == "invalid":
        return EvaluationResult(
            query=query,
            response=response,
            feedback=feedback,
            invalid_result=True,
            invalid_reason="no verdict could be read from the judge's replies",
        )
    return EvaluationResult(
        query=query,
        response=response,
        contexts=contexts,
        passing={"A": True, "B": False}.get(v),
        score={"A": 1.0, "B": 0.0, "tie": 0.5}[v],
        feedback=feedback,
        pairwise_source=EvaluationSource.ORIGINAL if res.consistent else EvaluationSource.NEITHER,
    )


def evaluator_class() -> type:
    """Build the LlamaIndex evaluator class (llama-index-core is imported only when asked for)."""
    from llama_index.core.evaluation import BaseEvaluator, EvaluationResult

    class RagfixPairwiseEvaluator(BaseEvaluator):
        """A LlamaIndex evaluator with the interface of ``PairwiseComparisonEvaluator``
        (``llama_index.core.evaluation``, 0.14): ``evaluate(query, response, second_response=...,
        reference=...)`` -> ``EvaluationResult`` with ``score`` 1.0 (``response`` better), 0.0
        (``second_response`` better) or 0.5 (tie), ``passing`` True / False / None.

        The pair is always judged in both orders by a :class:`PairwiseJudge`; the result carries an
        order-free verdict instead of LlamaIndex's vote rule:

        * ``verdict="logit"`` (default): the calibrated logit verdict (the ``verdict`` and
          ``answer`` styles, which give the two answers' probabilities);
        * ``verdict="swap"``: the MT-bench swap-aggregated verdict (inconsistent -> tie).

        ``pairwise_source`` is ``"original"`` when both orders agree and ``"neither"`` when they do
        not; ``feedback`` holds both orders' raw replies and verdicts; an unparseable verdict, or
        a judge prompt that does not fit the model's window (not judged), gives
        ``invalid_result=True``.

        Raises:
            ConfigError: ``verdict="logit"`` with a judge of the ``explain`` style.
            RagfixError: ``evaluate`` without ``query``, ``response`` or ``second_response``.
        """

        def __init__(self, judge: PairwiseJudge, verdict: Literal["logit", "swap"] = "logit"):
            if verdict == "logit" and judge.style == "explain":
                raise ConfigError(
                    "the logit verdict needs the answers' probabilities: a judge with "
                    "style='verdict' or style='answer', not 'explain'"
                )
            self.judge = judge
            self.verdict = verdict

        def _get_prompts(self) -> dict:
            return {}

        def _update_prompts(self, prompts: dict) -> None:
            """The judge prompt is fixed (its wording is part of what is measured)."""

        async def aevaluate(  # type: ignore[override]
            self,
            query: str | None = None,
            response: str | None = None,
            contexts: Sequence[str] | None = None,
            second_response: str | None = None,
            reference: str | None = None,
            sleep_time_in_seconds: int = 0,
            **kwargs: Any,
        ) -> EvaluationResult:
            """Judge ``response`` against ``second_response`` for ``query`` in both orders."""
            if query is None or response is None or second_response is None:
                raise RagfixError("query, response and second_response must be provided")
            res = self.judge.judge(query, response, second_response, reference)
            return _result(res, self.verdict, query, response, contexts)

    return RagfixPairwiseEvaluator
