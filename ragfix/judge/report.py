"""The report of a judge run: its tables (:func:`judge_tables`, the one rendering of a judge
summary, printed by ``ragfix judge`` and rendered into Markdown by ``ragfix render``) and the PNG
(one row per judge)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from ragfix.io import atomic_write_bytes
from ragfix.judge.metrics import (
    VERDICT_KINDS,
    paired_agreement,
    record_verdict,
    verdict_correct,
)
from ragfix.judge.verdicts import EMPTY_JUDGE_REPLY
from ragfix.tables import TableSpec, fmt_ci, fmt_num, fmt_signed, print_tables
from ragfix.types import OVERFLOW

#: ``"kind"`` of a judge run's ``summary.json`` (``ragfix judge``, :mod:`ragfix.eval.judge_run`)
JUDGE_KIND = "ragfix-judge"


#: ``"format"`` of a judge summary computed from other judges' verdicts (``--from-judgments``;
#: the swap-judgments format of :mod:`ragfix.connectors.pairwise`)
SWAP_JUDGMENTS_FORMAT = "swap_judgments"


def _pc(m: dict) -> str:
    """Position consistency with its counts: ``0.928 (389/419)`` (consistent / both orders read)."""
    pc = m["position_consistency"]
    return f"{'n/a' if pc is None else fmt_num(pc)} ({m['consistent_pairs']}/{m['valid_pairs']})"


def _rate(x: float | None, signed: bool = False) -> str:
    return "n/a" if x is None else fmt_signed(x) if signed else fmt_num(x)


def _acc_kappa(g: dict | None) -> str:
    """``accuracy / kappa`` of one verdict kind's agreement (``n/a`` without labels)."""
    return "n/a" if g is None else f"{fmt_num(g['accuracy'])} / {_rate(g['kappa'], signed=True)}"


def judge_tables(result: dict) -> list[TableSpec]:
    """The tables of a judge run's ``summary.json`` (``ragfix judge``,
    :mod:`ragfix.eval.judge_run`; ``"kind": "ragfix-judge"``).

    A summary of other judges' verdicts (``ragfix judge --from-judgments``) is one table, one row
    per judge: position consistency with its counts (consistent / pairs both of whose verdicts
    were read), preference fairness, first-slot win rate, invalid rate, and accuracy / Cohen's
    kappa against the human labels of the single-order (original order) and swap-aggregated
    verdicts.

    A judged run (a model as the judge) is two tables per judge: position bias per verdict source
    (generated verdicts, per-order argmax of the letter probabilities): consistency with its
    counts, fairness, first-slot wins, tie and invalid rates, with the pairs that overflow, the
    orders the judge model gave no reply text for (``empty_judge_reply``, with the server's
    reasons and how often each was given), the mean probability of the verdict letters (and the
    repetition stability, the run's notes) under it; then agreement with
    the human labels per verdict kind (n, accuracy with its 95% Wilson interval, kappa, ties,
    invalid), or a line saying the data has no labels.
    """
    data = Path(result["data"]).name
    limit = result.get("limit")
    judges = result["judges"]
    if result.get("format") == SWAP_JUDGMENTS_FORMAT:
        rows = [
            [
                name,
                _pc(s["generated"]),
                _rate(s["generated"]["preference_fairness"], signed=True),
                _rate(s["generated"]["first_slot_win_rate"]),
                _rate(s["generated"]["invalid_rate"]),
                _acc_kappa(s["agreement"].get("single_original")),
                _acc_kappa(s["agreement"].get("swap_aggregated")),
            ]
            for name, s in judges.items()
        ]
        headers = [
            "judge",
            "PC (consistent/read)",
            "PF",
            "first-slot wins",
            "invalid",
            "single-order acc / κ",
            "swap-aggregated acc / κ",
        ]
        items = f"first {limit} items" if limit is not None else "all items"
        line = (
            f"{data}, {items} of each judge. Single order: the verdict of the order given in the "
            "file; swap-aggregated: both orders, an inconsistent pair is a tie (MT-bench)."
        )
        title = f"Other judges' verdicts in both orders ({items})"
        return [TableSpec(title, headers, rows, [line])]
    tables = []
    for name, s in judges.items():
        where = f"{data}, first {limit} pairs" if limit is not None else data
        if result.get("records"):
            where += f", records {result['records']}"
        rows = []
        sources = (
            ("generated", "generated"),
            ("logit", "logit argmax"),
            ("contextual", "contextual argmax"),
        )
        for source, label in sources:
            m = s.get(source)
            if m is not None:
                rows.append(
                    [
                        label,
                        str(m["pairs"]),
                        _pc(m),
                        _rate(m["preference_fairness"], signed=True),
                        _rate(m["first_slot_win_rate"]),
                        _rate(m["tie_rate"]),
                        _rate(m["invalid_rate"]),
                    ]
                )
        headers = [
            "verdicts",
            "pairs",
            "PC (consistent/read)",
            "PF",
            "first-slot wins",
            "ties",
            "invalid",
        ]
        lines = []
        if s.get("overflow_pairs"):
            lines.append(
                f"{s['overflow_pairs']} pair(s) overflow the context window: not judged, left "
                "out of every metric."
            )
        empty = s.get("empty_reply_reasons") or {}
        if empty:
            why = "; ".join(f"{reason}: {n}" for reason, n in empty.items())
            lines.append(
                f"{s['flags'].get(EMPTY_JUDGE_REPLY, 0)} pair(s) flagged {EMPTY_JUDGE_REPLY}: "
                f"the judge model gave no reply text in {sum(empty.values())} order(s), read as "
                f"invalid verdicts (the server said {why})."
            )
        if s.get("letter_mass") is not None:
            lines.append(f"Mean p(A) + p(B) at the verdict position: {fmt_num(s['letter_mass'])}.")
        cf = result.get("content_free")
        if cf:
            priors = ", ".join(
                f"{k}: {fmt_num(a)} / {fmt_num(b)}" for k, (a, b) in cf["priors"].items()
            )
            lines.append(
                f"Contextual calibration (Zhao et al. 2021): content-free prior p_cf(A) / p_cf(B) "
                f"per letter layout {priors}; {cf['passes']} model passes for the whole run."
            )
        if s.get("repetition_stability") is not None:
            lines.append(f"Repetition stability: {fmt_num(s['repetition_stability'])}.")
        if s.get("seconds_per_pair") is not None:
            lines.append(
                f"Model wall time per pair: {s['seconds_per_pair']:.2f} s for both orders (two "
                "passes: a one-order verdict costs half)."
            )
        lines += list(result.get("notes", []))
        tables.append(TableSpec(f"{name} as judge: position bias ({where})", headers, rows, lines))
        agree = [
            [
                kind,
                str(g["n"]),
                fmt_num(g["accuracy"]),
                fmt_ci({"low": g["acc_low"], "high": g["acc_high"]}),
                _rate(g["kappa"], signed=True),
                str(g["ties"]),
                str(g["invalid"]),
            ]
            for kind, g in s["agreement"].items()
            if g is not None
        ]
        title = f"{name} as judge: agreement with human labels ({where})"
        if agree:
            headers = ["verdict", "n", "accuracy", "95% CI", "κ", "ties", "invalid"]
            tables.append(TableSpec(title, headers, agree))
        else:
            tables.append(TableSpec(title, lines=["No human labels in the data."]))
    return tables


def print_judge_summary(result: dict, console: Console | None = None) -> None:
    """Print :func:`judge_tables` of a judge summary, then what each verdict kind is."""
    console = console or Console()
    print_tables(judge_tables(result), console)
    if result.get("format") != SWAP_JUDGMENTS_FORMAT:
        for kind, (_, desc) in VERDICT_KINDS.items():
            console.print(f"  {kind}: {desc}", highlight=False)


def _plot_consistency(ax, summaries: dict[str, dict]) -> None:
    """Stacked bars, one per judge and verdict source: shares of consistent pairs, pairs
    inconsistent towards the first / second slot, and pairs with an unreadable order."""
    rows = []
    for name, s in summaries.items():
        for kind in ("generated", "logit"):
            if s.get(kind) is not None:
                rows.append((name if kind == "generated" else f"{name} (logit argmax)", s[kind]))
    names = [r[0] for r in rows]
    left = [0.0] * len(rows)
    parts = [
        ("consistent", "consistent_pairs", "#2a9d8f"),
        ("favours first slot", "primacy_pairs", "#e76f51"),
        ("favours second slot", "recency_pairs", "#f4a261"),
    ]
    for label, key, color in parts:
        vals = [m[key] / m["pairs"] if m["pairs"] else 0.0 for _, m in rows]
        ax.barh(names, vals, left=left, color=color, label=label)
        for i, v in enumerate(vals):
            if v >= 0.06:
                ax.text(left[i] + v / 2, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    rest = [1.0 - x for x in left]
    ax.barh(names, rest, left=left, color="#bbbbbb", label="an order unreadable")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("share of pairs (each judged in both orders)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4)
    ax.set_title("position consistency", fontsize=10)


def _plot_agreement(ax, summaries: dict[str, dict]) -> None:
    """Grouped bars per judge: accuracy against the human labels of three verdict kinds."""
    kinds = [("single_original", "single order"), ("swap_aggregated", "swap-aggregated"),
             ("logit_calibrated", "calibrated logit")]  # fmt: skip
    judge_names = list(summaries)
    width = 0.8 / len(kinds)
    for k, (kind, label) in enumerate(kinds):
        ys, xs = [], []
        for i, name in enumerate(judge_names):
            g = summaries[name]["agreement"].get(kind)
            if g is not None:
                ys.append(i + (k - 1) * width)
                xs.append(g["accuracy"])
        if xs:
            ax.barh(ys, xs, height=width, label=label)
    ax.set_yticks(range(len(judge_names)), judge_names)
    ax.axvline(0.5, color="k", ls="--", lw=0.8)
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("accuracy vs human labels")
    ax.set_title("agreement with humans", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)


def plot_judges(summaries: dict[str, dict], path, title: str | None = None) -> None:
    """A PNG to read at a glance, one row per judge (written atomically).

    Left: what happened to each pair across the two orders, as shares of all pairs: consistent,
    inconsistent towards the first slot, towards the second slot, an order unreadable. Right:
    accuracy against the human labels of the single-order, swap-aggregated and calibrated logit
    verdicts (dashed line: always picking one side on balanced labels).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sum(
        s.get(kind) is not None for s in summaries.values() for kind in ("generated", "logit")
    )
    fig, (ax, ax2) = plt.subplots(
        1, 2, figsize=(12, 2.2 + 0.55 * rows), dpi=110, gridspec_kw={"width_ratios": [3, 2]}
    )
    _plot_consistency(ax, summaries)
    _plot_agreement(ax2, summaries)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _as_first(first: dict[str, tuple[str, dict]], mine: dict[str, tuple[str, dict]]) -> str:
    """On the pairs both runs judged: how many one-pass verdicts equal the first run's, and the
    largest difference of the letter probability ``p(A)`` in either order (``-`` without
    letter probabilities)."""
    shared = sorted(set(first) & set(mine))
    if not shared:
        return "n/a"
    same = sum(first[k][0] == mine[k][0] for k in shared)
    diffs = [
        abs(first[k][1][order]["p_a"] - mine[k][1][order]["p_a"])
        for k in shared
        for order in ("original", "swapped")
        if first[k][1][order].get("p_a") is not None and mine[k][1][order].get("p_a") is not None
    ]
    return f"{same}/{len(shared)}, " + (f"{max(diffs):.3f}" if diffs else "-")


def judge_comparison(
    results: dict[str, dict], judgments: dict[str, list[dict]] | None = None
) -> TableSpec:
    """One row per judge run (``{run name: summary.json}``, each with one judge): its one-pass
    verdict against its two-pass swap aggregate, on the same footing.

    The one-pass verdict is the first order's, one forward pass per pair: the argmax of its
    letter probabilities (``A`` against ``B``; in the ``answer`` style of the two answers'
    likelihoods), with ``--calibrate content-free`` of the contextually calibrated ones (Zhao et
    al., ICML 2021; the calibration's content-free passes are per run, not per pair), and the
    generated verdict where the judge gives no probabilities (``explain``, a server without
    log-probabilities).
    Its position consistency (consistent / pairs both of whose verdicts were read, with the
    Wilson 95% interval) is measured under the run's swap; its accuracy (Wilson 95% interval)
    against the human labels. The swap-aggregated verdict reads both orders (two passes; an
    inconsistent pair is a tie and counts as wrong), and so does the calibrated logit verdict
    (both orders' normalised letter probabilities, or in the ``answer`` style answer
    likelihoods, averaged: order-free by construction).

    With ``judgments`` (``{run name: its judgments.jsonl records}``), each run's one-pass
    verdict is tested against the one-pass verdict of the first run listed with the same judge
    model and pair file, on the labelled pairs both judged (exact McNemar,
    :func:`~ragfix.judge.metrics.paired_agreement`); that first run reads ``baseline``.

    Raises:
        KeyError: a summary that is not a judged run's (``--from-judgments`` summaries have no
            one-pass verdict of their own).
    """
    rows = []
    baselines: dict[tuple[str, str], dict[str, bool]] = {}
    first_runs: dict[tuple[str, str], dict[str, tuple[str, dict]]] = {}
    for name, result in results.items():
        config = result["config"]
        [(judge, s)] = result["judges"].items()
        calibrated = config.get("calibrate", "none") != "none"
        source, agreement = (
            ("contextual", "contextual_original")
            if calibrated
            else ("logit", "logit_original")
            if s.get("logit") is not None
            else ("generated", "single_original")
        )
        tested = []
        if judgments is not None:
            field = {"single_original": "verdict_original"}.get(agreement, agreement)
            mine = verdict_correct(judgments[name], field)
            base = baselines.setdefault((config["model"], config["data"]), mine)
            test = paired_agreement(base, mine)
            tested = [
                "baseline"
                if base is mine
                else "n/a"
                if test is None
                else f"{test['p_value']:.3g} (+{test['only_other']} / -{test['only_baseline']})"
            ]
            judged = {
                r["pair_id"]: (record_verdict(r, field), r)
                for r in judgments[name]
                if OVERFLOW not in r.get("flags", ())
            }
            first = first_runs.setdefault((config["model"], config["data"]), judged)
            tested.append("baseline" if first is judged else _as_first(first, judged))
        m, acc = s[source], s["agreement"].get(agreement)
        swap = s["agreement"].get("swap_aggregated")
        logit = s["agreement"].get("logit_calibrated")
        pc_ci = {"low": m["pc_low"], "high": m["pc_high"]} if m["pc_low"] is not None else None
        rows.append(
            [
                name,
                config["model"],
                config["backend"],
                config["style"],
                config.get("labels", "slot"),
                config.get("calibrate", "none"),
                str(s["pairs"]),
                _pc(m),
                fmt_ci(pc_ci),
                _rate(m["first_slot_win_rate"]),
                "n/a" if acc is None else fmt_num(acc["accuracy"]),
                "n/a" if acc is None else fmt_ci({"low": acc["acc_low"], "high": acc["acc_high"]}),
                "n/a" if swap is None else fmt_num(swap["accuracy"]),
                "n/a" if logit is None else fmt_num(logit["accuracy"]),
                "n/a" if s.get("seconds_per_pair") is None else f"{s['seconds_per_pair']:.2f}",
                *tested,
            ]
        )
    headers = [
        "run",
        "model",
        "backend",
        "style",
        "labels",
        "calibration",
        "pairs",
        "one-pass PC",
        "95% CI",
        "first-slot wins",
        "one-pass accuracy",
        "95% CI",
        "swap-aggregated accuracy (2 passes)",
        "calibrated logit accuracy (2 passes)",
        "seconds per pair (2 passes)",
    ]
    if judgments is not None:
        headers += [
            "one pass vs the model's first run: McNemar p (right only here / there)",
            "as the first run: same one-pass verdicts, largest p(A) difference",
        ]
    line = (
        "One-pass verdict: the first order's argmax of p(A) against p(B) (1 pass a pair; with "
        "content-free calibration of the calibrated ones; style answer: the more likely answer "
        "as the reply); PC under the ordinary swap (the answers exchange slots). Seconds: the "
        "model's wall time for both orders of a pair, as the run measured it. "
        "Intervals: Wilson 95%."
    )
    return TableSpec(
        "Judge corrections: one pass against the swap aggregate", headers, rows, [line]
    )
