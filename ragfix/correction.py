"""The correction every framework component applies: one place, framework-neutral.

:class:`CorrectionFields` holds the settings (pydantic fields, validated when built, unknown
ones refused); the components of each framework declare them by inheriting it:
:class:`ragfix.postprocessor.RagFixPostprocessor` (LlamaIndex),
:class:`ragfix.integrations.langchain.RagFixCompressor` (LangChain) and
:class:`ragfix.integrations.haystack.RagFixRanker` (Haystack, through
:class:`CorrectionSettings`). :class:`Correction` checks them against the backend once and runs
the steps on a list of :class:`Candidate` texts in retrieval order:

1. drop blank candidates (no word in their text, :func:`ragfix.pruning.drop_blank`);
2. drop near-duplicates (:func:`ragfix.pruning.drop_near_duplicates`, on the text the LLM reads);
3. fit the backend's token budget, dropping the lowest-ranked whole candidates first
   (:func:`ragfix.pruning.fit_budget`; the best one is never cut: an error, or a warning and
   nothing passed on);
4. reorder with the strategy (:mod:`ragfix.reorder`).

The report (:attr:`Correction.last_report`) names what was dropped and the order, and
:attr:`Correction.last_passages` holds the texts passed on, in prompt order (what makes each
component a :class:`ragfix.answering.PassageSource` for an LLM component's ``passages_from``).
The adapters only turn their framework's documents into candidates and back.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ragfix.errors import ConfigError
from ragfix.pruning import BudgetError, drop_blank, drop_near_duplicates, fit_budget
from ragfix.reorder import (
    ATTENTION_STRATEGIES,
    STRATEGIES,
    ProfileError,
    attention_sort_order,
    check_strategy,
    load_profile,
    static_order,
)
from ragfix.tasks import get_task
from ragfix.types import Passage

if TYPE_CHECKING:
    from ragfix.backends.base import Backend


class CorrectionFields(BaseModel):
    """The settings of the correction, as pydantic fields (a mixin for the framework components).

    Attributes:
        strategy: one of ``none``, ``lost-in-the-middle``, ``reverse``, ``bias-profile``,
            ``attention-sort`` (see :mod:`ragfix.reorder`).
        profile: for ``bias-profile``: a sweep's ``summary.json`` path or a list of accuracies per
            prompt position; it is checked against the backend's model and ``num_docs``.
        profile_curve: which curve of the summary to use when it holds several.
        num_docs: the number of documents the profile must cover (checked when set; otherwise the
            profile's length must equal the number of documents that reach the reorder step).
        dedup_threshold: word-3-gram Jaccard similarity at which a document counts as a duplicate
            of a higher-ranked one (``None`` keeps duplicates).
        token_budget: tokens the documents may take (at most the backend's context window);
            default: the backend's context window minus ``reserve_tokens`` (``None`` without a
            backend: no budget fitting).
        reserve_tokens: tokens kept for the template, the question and the answer.
        over_budget: when the best document alone exceeds the budget: ``error`` raises
            :class:`~ragfix.pruning.BudgetError`, ``warn`` warns and passes nothing on.
        attention_rounds: sorting rounds of the attention strategies.
        attention_layers: the layers whose attention they average: ``upper`` (the upper half)
            or ``all`` (:class:`~ragfix.backends.attention_sort.AttentionSortOptions`).
        attention_task: the QA task whose prompt the attention strategies read the passages
            in (:mod:`ragfix.tasks`; the one the LLM answers with, read once: ``qa``,
            ``qa-extractive``, ``qa-extractive-2shot``).
    """

    strategy: str = Field(default="lost-in-the-middle", description=", ".join(STRATEGIES))
    profile: str | list[float] | None = Field(default=None, description="bias-profile source")
    profile_curve: str | None = Field(default=None, description="curve label in summary.json")
    num_docs: int | None = Field(default=None, gt=0, description="documents the profile covers")
    dedup_threshold: float | None = Field(default=0.9, gt=0, le=1)
    token_budget: int | None = Field(default=None, gt=0)
    reserve_tokens: int = Field(default=512, ge=0)
    over_budget: Literal["error", "warn"] = Field(default="error")
    attention_rounds: int = Field(default=1, ge=1)
    attention_layers: Literal["upper", "all"] = Field(default="upper")
    attention_task: str = Field(default="qa")

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        return check_strategy(v)

    @field_validator("attention_task")
    @classmethod
    def _a_qa_task_read_once(cls, v: str) -> str:
        task = get_task(v)
        if task.data_format != "qa" or task.repeat != "none":
            raise ValueError(f"{v!r} is not a QA task read once (qa, qa-extractive, ...)")
        return v

    def correction_settings(self) -> dict:
        """The correction settings alone (the fields of this mixin), as a dict."""
        return {k: getattr(self, k) for k in CorrectionFields.model_fields}


class CorrectionSettings(CorrectionFields):
    """The correction settings on their own: frozen, unknown settings refused
    (``pydantic.ValidationError``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Candidate:
    """One retrieved document as the correction sees it.

    Attributes:
        id: the framework's id of the document (reported when it is dropped).
        text: what the LLM reads for it (near-duplicates and the budget are judged on this).
        content: its bare content (blank check, attention-sort); default: ``text``.
        title: its title (attention-sort renders it like the task prompt).
    """

    id: str
    text: str
    content: str | None = None
    title: str = ""

    @property
    def bare(self) -> str:
        """The bare content (``content``, else ``text``)."""
        return self.text if self.content is None else self.content


class Correction:
    """The correction steps with validated settings, checked against the backend once.

    Args:
        settings: a :class:`CorrectionFields` instance (a framework component, or
            :class:`CorrectionSettings`).
        backend: a :class:`ragfix.backends.Backend` (token counting, model identity of a profile,
            attention-sort); optional for the content-blind strategies without a budget.
        noun: what the framework calls a document (``node``, ``document``), for messages.

    Attributes:
        last_report: what the last :meth:`apply` did (see there).
        last_passages: the :attr:`Candidate.text` of each candidate the last :meth:`apply`
            passed on, in prompt order (``None`` before the first call and after a call that
            raised).

    Raises:
        ConfigError: ``bias-profile`` without a profile, ``attention-sort`` or ``token_budget``
            without a backend, a budget larger than the backend's window or ``reserve_tokens``
            that leave none.
        ragfix.reorder.ProfileError: a profile of another model or number of documents.
    """

    def __init__(
        self, settings: CorrectionFields, backend: Backend | None = None, noun: str = "document"
    ) -> None:
        self.settings = CorrectionSettings(**settings.correction_settings())
        self.backend, self.noun = backend, noun
        self.last_report: dict = {}
        self.last_passages: list[str] | None = None
        s = self.settings
        self.accuracies: list[float] | None = None
        if s.strategy == "bias-profile":
            if s.profile is None:
                raise ConfigError("strategy 'bias-profile' needs profile= (summary.json path)")
            model = backend.model_name if backend is not None else None
            self.accuracies = load_profile(s.profile, model, s.num_docs, s.profile_curve)
        if s.strategy in ATTENTION_STRATEGIES and backend is None:
            raise ConfigError(f"strategy {s.strategy!r} needs backend= (it reads the attention)")
        if backend is None:
            if s.token_budget is not None:
                raise ConfigError("token_budget needs backend= to count tokens")
            return
        window = backend.context_window
        if s.token_budget is not None and s.token_budget > window:
            raise ConfigError(
                f"token_budget={s.token_budget} is larger than the {window}-token window of "
                f"{backend.model_name}"
            )
        if s.token_budget is None and window - s.reserve_tokens <= 0:
            raise ConfigError(
                f"reserve_tokens={s.reserve_tokens} leaves no token budget in the "
                f"{window}-token window of {backend.model_name}"
            )

    @property
    def budget(self) -> int | None:
        """Tokens the documents may take (``None``: no budget fitting)."""
        if self.settings.token_budget is not None:
            return self.settings.token_budget
        if self.backend is None:
            return None
        return self.backend.context_window - self.settings.reserve_tokens

    def apply(self, candidates: Sequence[Candidate], query: str | None = None) -> list[int]:
        """Correct and reorder ``candidates`` (retrieval order, index 0 = best).

        Args:
            candidates: the retrieved documents in retrieval order.
            query: the question (``attention-sort`` reads it; ``""`` when missing).

        Returns:
            indices into ``candidates`` in prompt order (the kept ones only). The report of this
            call is in :attr:`last_report`: ``dropped_blank``, ``dropped_duplicates``,
            ``dropped_budget`` (candidate ids, retrieval order), ``order`` (rank at each prompt
            position, ranks of the kept candidates) and, for attention-sort, ``attention`` (per
            round, per kept rank).

        Raises:
            ragfix.pruning.BudgetError: (``over_budget="error"``) the best candidate alone
                exceeds the token budget.
            ragfix.reorder.ProfileError: the profile does not cover the kept candidates (the
                message says what was dropped).
        """
        s = self.settings

        def ids(dropped) -> list[str]:
            return [candidates[i].id for i in sorted(dropped)]

        report: dict = {"dropped_blank": [], "dropped_duplicates": [], "dropped_budget": []}
        self.last_report, self.last_passages = report, None
        keep = drop_blank([c.bare for c in candidates])
        report["dropped_blank"] = ids(set(range(len(candidates))) - set(keep))
        texts = [candidates[i].text for i in keep]
        if s.dedup_threshold is not None:
            unique = drop_near_duplicates(texts, s.dedup_threshold)
            report["dropped_duplicates"] = ids(keep[j] for j in set(range(len(keep))) - set(unique))
            keep, texts = [keep[j] for j in unique], [texts[j] for j in unique]
        budget = self.budget
        if budget is not None and keep:
            try:
                fit = fit_budget(texts, budget, self.backend.count_tokens)
            except BudgetError as e:
                if s.over_budget == "error":
                    raise
                warnings.warn(f"{e}; no {self.noun} is passed on", UserWarning, stacklevel=3)
                fit = []
            report["dropped_budget"] = ids(keep[len(fit) :])
            keep = [keep[j] for j in fit]
        if s.strategy in ATTENTION_STRATEGIES:
            passages = [Passage(title=candidates[i].title, text=candidates[i].bare) for i in keep]
            order, attention = attention_sort_order(
                self.backend,
                query or "",
                passages,
                s.attention_rounds,
                task=s.attention_task,
                layers=s.attention_layers,
                calibrate=s.strategy == "attention-sort-calibrated",
            )
            report["attention"] = attention
        else:
            try:
                order = static_order(s.strategy, len(keep), self.accuracies)
            except ProfileError as e:
                dropped = [f"{len(v)} {k[8:]}" for k, v in report.items() if v]
                hint = ", set dedup_threshold=None" if report["dropped_duplicates"] else ""
                raise ProfileError(
                    f"{e} ({len(candidates)} {self.noun}s given, dropped: "
                    f"{', '.join(dropped) or 'none'}{hint})"
                ) from None
        report["order"] = order
        passed = [keep[r] for r in order]
        self.last_passages = [candidates[i].text for i in passed]
        return passed


__all__ = ["Candidate", "Correction", "CorrectionFields", "CorrectionSettings"]
