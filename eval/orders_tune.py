"""The tune of order marginalization's defaults from one sweep's recorded votes.

A sweep run with ``--orders K`` keeps every order's answer and confidence in each record
(``extra["votes"]``). Every smaller number of orders ``K' < K`` whose orders are among the
recorded ones (``rotate``: the evenly spaced shifts of ``K'``, e.g. shifts 0, 2, 4, 6 of 8;
``shuffle``: the first ``K'`` orders, drawn from the same seeded sequence) and every aggregator
is then scored from the same answers (``score`` and ``score-max`` from a run that recorded
the candidates' scores, made with either), with the function the backend itself chooses with
(:func:`ragfix.backends.orders.choose`): no model is run. The default is the setting with the
best worst position, then the best mean, then the fewer orders (the cheaper).

The table also has the ceiling of every aggregator of the run's ``K`` orders: the accuracy when a
cell counts as right if any of its orders answered right. It is not a setting (no aggregator can
know which order that is) and is never the default; the distance between it and an aggregator is
what choosing among the orders' answers loses.

Run: ``ragfix tune orders RUN --json results/NAME.json``, ``RUN`` a sweep of the tune range.
"""

from __future__ import annotations

from pathlib import Path

from ragfix.backends.orders import SCORED, OrderOptions, choose, passage_orders
from ragfix.errors import DataError
from ragfix.eval.compare import load_run
from ragfix.tables import TableSpec, tune_rows
from ragfix.tasks import get_task, run_task

#: the aggregators scored, in the order of the table (``score`` and ``score-max`` only from a
#: run that recorded the candidates' scores: one made with either)
AGGREGATORS = ("plurality", "weighted", "max", "score", "score-max")


def tune_orders(run: str | Path) -> tuple[TableSpec, dict]:
    """Accuracy per gold position of every derivable (orders, aggregator) setting of ``run``.

    Args:
        run: a finished sweep folder made with ``--orders`` (its scored cells are used, as
            ``ragfix report`` uses them).

    Returns:
        ``(table, details)``: one row per setting (accuracy per position, mean, worst
        position), the default marked, then the ceiling's row; ``details`` holds the run, its
        range, the accuracies, the ``ceiling`` (accuracy per position) and the ``default``
        (``{"orders", "aggregate"}``).

    Raises:
        DataError: not a run folder (:func:`~ragfix.eval.compare.load_run`), a run made
            without ``--orders``, a record without its votes, or a record of a ``shuffle``
            run without its prompt (its orders are seeded by the prompt's text).
    """
    loaded = load_run(run)
    options = loaded.config.get("backend_options", {}).get("orders")
    if options is None:
        raise DataError(loaded.folder, None, "orders", "a run made without --orders")
    recorded = OrderOptions(**options)
    task = get_task(run_task(loaded.config))
    scored = {(s, p) for cells in loaded.curves.values() for s, p in cells}
    records = [r for r in loaded.records if (r["sample_id"], r["position"]) in scored]
    positions = sorted({r["position"] for r in records})
    for r in records:
        if not r.get("extra", {}).get("votes"):
            raise DataError(loaded.folder, None, "votes", f"cell {r['cell_id']} has none")
        if recorded.design == "shuffle" and r.get("prompt") is None:
            raise DataError(
                loaded.folder, None, "prompt", f"cell {r['cell_id']} has none (the shuffle "
                "design's orders are seeded by the prompt: rerun without --no-log-prompts)"
            )  # fmt: skip
    hits: dict[str, list[int]] = {}
    for k in range(2, recorded.orders + 1):
        sub = recorded.model_copy(update={"orders": k})
        picks = []
        for r in records:
            votes = r["extra"]["votes"]
            key = r["prompt"]["text"] if recorded.design == "shuffle" else ""
            by_order = {tuple(v["order"]): v for v in votes}
            wanted = passage_orders(len(votes[0]["order"]), sub, key)
            if not all(o in by_order for o in wanted):
                break
            picks.append([by_order[o] for o in wanted])
        else:
            scored_votes = all("scores" in v for votes in picks for v in votes)
            for how in AGGREGATORS:
                if how in SCORED and not scored_votes:
                    continue
                row = [0] * len(positions)
                for r, votes in zip(records, picks, strict=True):
                    answer = votes[choose(votes, how)]["answer"]
                    row[positions.index(r["position"])] += task.score(answer, r["gold_answers"])
                hits[f"orders={k} aggregate={how}"] = row
    ceiling = [0] * len(positions)
    for r in records:
        right = any(task.score(v["answer"], r["gold_answers"]) for v in r["extra"]["votes"])
        ceiling[positions.index(r["position"])] += right
    n = len(records) // len(positions)
    rates = {name: [h / n for h in row] for name, row in hits.items()}
    ceiling_rates = [h / n for h in ceiling]
    ceiling_name = f"ceiling: any of the {recorded.orders} orders right"
    names = list(rates)
    best = max(
        names, key=lambda m: (min(rates[m]), sum(rates[m]), -int(m.split()[0].split("=")[1]))
    )
    table = TableSpec(
        title=f"order marginalization tune · {loaded.config.get('model')} · "
        f"{recorded.design} design · records {loaded.config.get('records') or 'all'}",
        headers=["setting", *(f"pos {p}" for p in positions), "mean", "worst"],
        rows=[
            *tune_rows(rates, positions, best),
            *tune_rows({ceiling_name: ceiling_rates}, positions, ""),
        ],
        lines=[
            f"{n} samples x {len(positions)} gold positions, re-aggregated from the votes of "
            f"{loaded.name} (orders={recorded.orders}); accuracy of the marginal answer. "
            "Default: the best worst position, then the best mean, then fewer orders. "
            "Ceiling: a cell is right when any of its orders answered right (no aggregator "
            "does better; not a setting)."
        ],
    )
    k, how = (part.split("=")[1] for part in best.split())
    details = {
        "run": loaded.name,
        "data": loaded.config.get("data"),
        "records": loaded.config.get("records"),
        "design": recorded.design,
        "positions": positions,
        "samples": n,
        "accuracy": rates,
        "ceiling": ceiling_rates,
        "default": {"orders": int(k), "aggregate": how},
    }
    return table, details


__all__ = ["AGGREGATORS", "tune_orders"]
