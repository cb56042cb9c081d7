"""A position-bias gate for CI: conditions on a run's curve that make ``ragfix eval``,
``ragfix eval-pipeline`` and ``ragfix report`` exit non-zero when they fail.

A condition is ``FIGURE>=X`` or ``FIGURE<=X`` over one figure of merit of the comparison that
``ragfix report`` computes (:func:`~ragfix.eval.compare.compare_loaded`):

* ``mean``: the curve's mean accuracy over positions (percentile bootstrap interval over
  samples); for a pipeline run, its retrieval-weighted accuracy (each rank weighted by how often
  the retriever put the gold chunk there: what a user of the pipeline gets);
* ``worst``: its worst position's accuracy (Wilson interval);
* ``gap``: best minus worst position (bootstrap interval);
* ``diff``: the paired mean difference against the baseline curve (the first curve it is
  paired with: another run's, or a pipeline run's first strategy), with its paired bootstrap
  interval; refused for a natural-rank pipeline run, whose positions hold different questions.

A condition holds only when the whole 95% interval clears the threshold (``>=``: its low end
at or above; ``<=``: its high end at or below), the reading of a one-sided test at 2.5%: a
gate cannot pass by having too few questions, since few questions give a wide interval. A
``diff>=-0.05`` condition is a non-inferiority test with margin 0.05; ``diff>=0`` asks for a
gain. Where the estimate meets the threshold but its interval does not, the failure says that
the run's sample size cannot show it.

``mean``, ``worst`` and ``gap`` are checked on every curve of the last run (the run a command
made, or the last folder given to ``ragfix report``); ``diff`` on every paired comparison whose
other curve is in it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ragfix.errors import ConfigError

#: the figures a condition may name
FIGURES = ("mean", "worst", "gap", "diff")
_CONDITION = re.compile(r"\s*(mean|worst|gap|diff)\s*(>=|<=)\s*([+-]?(\d+\.?\d*|\.\d+))\s*")


class Condition(BaseModel):
    """One gate condition: ``figure`` ``op`` ``threshold`` (accuracy units, 0 to 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    figure: Literal["mean", "worst", "gap", "diff"]
    op: Literal[">=", "<="]
    threshold: float

    @classmethod
    def parse(cls, text: str) -> Condition:
        """``"worst>=0.3"`` as a condition.

        Raises:
            ConfigError: one line naming the text and the form expected.
        """
        m = _CONDITION.fullmatch(text)
        if not m:
            raise ConfigError(
                f"--gate {text!r}: expected FIGURE>=X or FIGURE<=X, FIGURE one of "
                f"{', '.join(FIGURES)} (e.g. worst>=0.3, gap<=0.1, diff>=-0.05)"
            )
        threshold = float(m[3])
        if m[1] != "diff" and not 0 <= threshold <= 1:
            raise ConfigError(f"--gate {text!r}: {m[1]} is an accuracy, between 0 and 1")
        return cls(figure=m[1], op=m[2], threshold=threshold)

    def __str__(self) -> str:
        return f"{self.figure}{self.op}{self.threshold:g}"


def parse_gates(texts: list[str] | None) -> list[Condition]:
    """The conditions of ``--gate`` options (validated before any work).

    Raises:
        ConfigError: see :meth:`Condition.parse`.
    """
    return [Condition.parse(t) for t in texts or []]


def _figures(comparison: dict, figure: str) -> list[tuple[str, float, float, float, int]]:
    """``(label, value, low, high, samples)`` of ``figure`` for each curve (or pair) it is
    checked on (module docstring)."""
    last = comparison["runs"][-1]
    if figure == "diff" and last.get("natural_ranks"):
        raise ConfigError(
            "--gate diff: a natural-rank pipeline run's paired mean difference weighs every "
            "rank alike (a rank of one question as much as rank 0); gate its mean (the "
            "retrieval-weighted accuracy), or sweep the ranks with --positions"
        )
    if figure == "diff":
        prefix = f"{last['name']}:"
        return [
            (
                f"{p['other']} vs {p['baseline']}",
                p["mean_diff"],
                *_bounds(p["mean_diff_ci"], -1.0),
                p["samples"],
            )  # fmt: skip
            for p in comparison.get("paired", [])
            if p["other"].startswith(prefix)
        ]
    out = []
    for curve, m in last["curves"].items():
        weighted = last.get("retrieval_weighted", {}).get(curve)
        if figure == "mean" and weighted:
            label = f"{last['name']}:{curve} (retrieval-weighted)"
            bounds = _bounds(weighted["ci"], 0.0)
            out.append((label, weighted["accuracy"], *bounds, weighted["retrieved"]))
            continue
        label = f"{last['name']}:{curve}"
        if figure == "worst":
            label += f" (position {m['worst_position']})"
        out.append((label, m[figure], *_bounds(m[f"{figure}_ci"], 0.0), m["samples"]))
    return out


def _bounds(ci: dict | None, lowest: float) -> tuple[float, float]:
    """An interval's ``(low, high)``; without one (a single sample), the widest the figure can
    take (``lowest`` to 1), which clears no threshold."""
    return (ci["low"], ci["high"]) if ci else (lowest, 1.0)


def gate_failures(comparison: dict, conditions: list[Condition]) -> list[str]:
    """One line per failing condition and curve (none: the gate passes).

    Raises:
        ConfigError: a ``diff`` condition with nothing to pair (one run, one curve, or runs
            whose cells differ): the gate cannot be read, so it is not passed silently.
    """
    lines = []
    for c in conditions:
        checked = _figures(comparison, c.figure)
        if not checked:
            raise ConfigError(
                f"--gate {c}: the run has no paired comparison (give a baseline run with the "
                "same cells, or a pipeline run with several strategies)"
            )
        for label, value, low, high, n in checked:
            bound = low if c.op == ">=" else high
            if (bound >= c.threshold) if c.op == ">=" else (bound <= c.threshold):
                continue
            met = (value >= c.threshold) if c.op == ">=" else (value <= c.threshold)
            why = (
                f"its estimate meets {c.threshold:g} but the interval does not: {n} samples "
                "cannot show it (give more questions)"
                if met
                else f"{'below' if c.op == '>=' else 'above'} {c.threshold:g}"
            )
            lines.append(
                f"gate {c} failed: {label} {c.figure} {value:.3f} "
                f"(95% CI [{low:.3f}, {high:.3f}], {n} samples): {why}"
            )
    return lines


__all__ = ["FIGURES", "Condition", "gate_failures", "parse_gates"]
