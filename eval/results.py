"""Result files under ``results/`` and the tables each kind renders as.

A result file is a comparison (:func:`ragfix.eval.compare.compare_runs`), a benchmark's table
(:func:`write_benchmark`), a perplexity result (:mod:`ragfix.eval.ppl`), a judge run's
``summary.json`` (:mod:`ragfix.eval.judge_run`) or a sweep's ``summary.json``; its ``kind`` field
says which (a sweep's summary has none). :func:`result_tables` turns one into
:class:`~ragfix.tables.TableSpec` tables by table kind (:data:`TABLE_KINDS`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ragfix.errors import DataError, RagfixError
from ragfix.eval.compare import COMPARISON_KIND, comparison_tables
from ragfix.eval.ppl_tables import PPL_KIND, ppl_tables
from ragfix.io import atomic_write_json
from ragfix.judge.report import JUDGE_KIND, judge_tables
from ragfix.tables import TableSpec

#: ``"kind"`` of a benchmark's result file (:func:`write_benchmark`)
BENCHMARK_KIND = "ragfix-benchmark"


#: table kinds of a comparison (``ragfix report`` prints ``comparison``: all of them), of a
#: benchmark, of a perplexity result and of a judge run
TABLE_KINDS = (
    "curve",
    "references",
    "merit",
    "paired",
    "comparison",
    "benchmark",
    "ppl",
    "judge",
)


#: table kinds that render one kind of result file only, and the only kind for that file:
#: table kind -> (the file's ``kind``, what the file is in an error message)
_FILE_TABLE_KINDS = {
    "benchmark": (BENCHMARK_KIND, "benchmark"),
    "ppl": (PPL_KIND, "perplexity"),
    "judge": (JUDGE_KIND, "judge"),
}


def write_benchmark(path: str | Path, table: TableSpec | list[TableSpec], **details) -> dict:
    """Write a benchmark's table (cells already formatted), or several tables, as a result file
    under ``results/``, with the details of the run (settings, raw figures) beside it; atomic.

    The first table's fields are the file's own (``title``, ``headers``, ``rows``, ``lines``);
    the tables after it, if any, are kept in the same shape under ``more_tables``.

    Returns:
        The written object (``"kind": "ragfix-benchmark"``, rendered by the ``benchmark`` table
        kind: every table, in order).
    """
    first, *more = table if isinstance(table, list) else [table]
    extra = {"more_tables": [_table_fields(t) for t in more]} if more else {}
    result = {"kind": BENCHMARK_KIND, **_table_fields(first), **extra, **details}
    atomic_write_json(path, result)
    return result


_TABLE_FIELDS = ("title", "headers", "rows", "lines")


def _table_fields(table: TableSpec) -> dict:
    return {k: getattr(table, k) for k in _TABLE_FIELDS}


def result_tables(result: dict, kind: str = "comparison") -> list[TableSpec]:
    """The tables of a result file (:func:`load_result`) of table kind ``kind``.

    Args:
        kind: ``curve``, ``references``, ``merit``, ``paired`` or ``comparison`` for a
            comparison or a ``summary.json`` (:func:`ragfix.eval.compare.comparison_tables`);
            ``benchmark`` for a benchmark's file (:func:`write_benchmark`: all its tables),
            ``ppl`` for a perplexity result (:func:`ragfix.eval.ppl_tables.ppl_tables`),
            ``judge`` for a judge run's ``summary.json``
            (:func:`ragfix.judge.report.judge_tables`).

    Raises:
        RagfixError: an unknown table kind.
        DataError: ``references``, ``merit`` or ``paired`` asked of a ``summary.json``;
            ``benchmark``, ``ppl`` or ``judge`` asked of another file, or another kind asked of
            their files.
    """
    if kind not in TABLE_KINDS:
        raise RagfixError(f"unknown table kind {kind!r} (one of: {', '.join(TABLE_KINDS)})")
    for table_kind, (file_kind, what) in _FILE_TABLE_KINDS.items():
        if (kind == table_kind) != (result.get("kind") == file_kind):
            raise DataError(
                result.get("source"),
                None,
                None,
                f"the {table_kind} table kind is for {what} result files, and only for them",
            )
    if kind == "benchmark":
        tables = [result, *result.get("more_tables", [])]
        return [TableSpec(**{k: t[k] for k in _TABLE_FIELDS}) for t in tables]
    if kind == "ppl":
        return ppl_tables(result)
    if kind == "judge":
        return judge_tables(result)
    return comparison_tables(result, kind)


def load_result(path: str | Path) -> dict:
    """A result file as a comparison: a comparison, benchmark, perplexity or judge JSON as it is
    (its ``kind`` field says which), or a run's ``summary.json`` wrapped as a one-run comparison
    (curves without bootstrap intervals, its reference points, nothing paired).

    Raises:
        DataError: missing, unreadable, or none of these files.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DataError(path, None, None, f"cannot read the result file ({e.strerror})") from None
    except ValueError as e:
        raise DataError(path, None, None, f"not JSON ({e})") from None
    kinds = (COMPARISON_KIND, BENCHMARK_KIND, PPL_KIND, JUDGE_KIND)
    if isinstance(data, dict) and data.get("kind") in kinds:
        return {**data, "source": str(path)}
    if not isinstance(data, dict) or not isinstance(data.get("curves"), dict):
        raise DataError(path, None, None, "neither a summary.json nor a comparison file")
    run = {
        "name": path.stem,
        "path": str(path.parent),
        "config": data.get("config", {}),
        "x_axis": data.get("x_axis", "prompt position"),
        "curves": data["curves"],
        **({"references": data["references"]} if data.get("references") else {}),
    }
    return {"kind": "summary", "source": str(path), "runs": [run], "paired": [], "notes": []}
