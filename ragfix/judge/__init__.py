"""Pairwise LLM-as-judge with position swap, order-free verdicts, and position-bias metrics.

Every pair (question, answer A, answer B) is judged twice: in the original order (A in the first
slot) and in the swapped order (B in the first slot). A judge that reads its first slot more
kindly than its second gives different answers in the two orders; the metrics measure how often
and in which direction, and the order-free verdicts remove the order's influence.

Modules, by concern:

* :mod:`~ragfix.judge.prompts`: the MT-bench judge templates (``verdict`` and ``explain`` styles);
* :mod:`~ragfix.judge.verdicts`: verdict parsing, unswapping, swap aggregation, the calibrated
  logit verdict, and the judgment records;
* :mod:`~ragfix.judge.judge`: :class:`PairwiseJudge` over any backend;
* :mod:`~ragfix.judge.metrics`: position consistency, preference fairness, first-slot win rate,
  agreement with human labels, repetition stability, summaries;
* :mod:`~ragfix.judge.report`: tables and the PNG;
* :mod:`~ragfix.judge.llamaindex`: ``RagfixPairwiseEvaluator``, built on first access.

Sources: MT-bench pairwise judging and swap aggregation (Zheng et al., NeurIPS 2023 Datasets and
Benchmarks, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena", section 3.4 and FastChat
``llm_judge``); position consistency, preference fairness and repetition stability (Shi et al.
2024, "Judging the Judges: A Systematic Investigation of Position Bias in Pairwise Comparative
Assessments by LLMs", arXiv 2406.07791, section 3, code Slimshilin/Position-Bias-Analyzer).
"""

from __future__ import annotations

from ragfix.judge.judge import PairwiseJudge, check_judge_settings, letter_token
from ragfix.judge.metrics import (
    VERDICT_KINDS,
    agreement,
    cohen_kappa,
    order_metrics,
    repetition_stability,
    summarize,
    summarize_swap_judgments,
)
from ragfix.judge.prompts import STYLES, VERDICT_PREFIX, content_labels, judge_prompt
from ragfix.judge.report import plot_judges, print_judge_summary
from ragfix.judge.verdicts import (
    EMPTY_JUDGE_REPLY,
    VERDICTS,
    OrderJudgment,
    PairJudgment,
    Verdict,
    combine,
    content_free_prior,
    contextual_calibration,
    letter_probs,
    logit_verdict,
    parse_verdict,
    swap_aggregate,
    unswap,
)
from ragfix.types import JudgePair, pair_id


def __getattr__(name: str):
    """``RagfixPairwiseEvaluator`` is created on first access, so importing :mod:`ragfix.judge`
    does not import LlamaIndex."""
    if name == "RagfixPairwiseEvaluator":
        from ragfix.judge.llamaindex import evaluator_class

        cls = evaluator_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EMPTY_JUDGE_REPLY",
    "STYLES",
    "VERDICTS",
    "VERDICT_KINDS",
    "VERDICT_PREFIX",
    "JudgePair",
    "OrderJudgment",
    "PairJudgment",
    "PairwiseJudge",
    "RagfixPairwiseEvaluator",
    "Verdict",
    "agreement",
    "check_judge_settings",
    "cohen_kappa",
    "combine",
    "content_free_prior",
    "content_labels",
    "contextual_calibration",
    "judge_prompt",
    "letter_probs",
    "letter_token",
    "logit_verdict",
    "order_metrics",
    "pair_id",
    "parse_verdict",
    "plot_judges",
    "print_judge_summary",
    "repetition_stability",
    "summarize",
    "summarize_swap_judgments",
    "swap_aggregate",
    "unswap",
]
