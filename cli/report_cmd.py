"""``ragfix report`` (compare runs: figures of merit, paired tests, plot, JSON) and ``ragfix
render`` (rewrite the results tables of Markdown files from ``results/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import GateOpt, check_gates, console, gate_conditions, user_errors
from ragfix.errors import ConfigError


def register(app: typer.Typer) -> None:
    """Add ``report`` and ``render`` to the CLI."""

    @app.command("report")
    def report_cmd(
        runs: Annotated[list[Path], typer.Argument(help="run folders (each with summary.json)")],
        out: Annotated[Path, typer.Option("--out", "-o", help="PNG to write")] = Path(
            "runs/compare.png"
        ),
        json_out: Annotated[
            Path | None,
            typer.Option("--json", help="write every number and the run configs to this JSON"),
        ] = None,
        markdown: Annotated[
            bool, typer.Option("--markdown", help="print the tables as Markdown")
        ] = False,
        title: Annotated[str | None, typer.Option(help="plot title")] = None,
        html: Annotated[
            Path | None,
            typer.Option(
                "--html",
                help="also write one self-contained HTML page: the plot, the tables and every "
                "cell with the prompt its model read",
            ),
        ] = None,
        gate: GateOpt = None,
    ) -> None:
        """Figures of merit of every curve (mean, worst position, best-worst gap, with 95%
        intervals) and their plot; a judge run's tables (position consistency, preference
        fairness, agreement); for several judge runs, one table of their one-pass verdicts
        against the two-pass swap aggregate (--json writes it as a result file).

        Curves of runs with the same cells (same data, number of passages, record range and
        prompt layout; the model, backend, adapter or task form may differ) are compared with the
        first
        one: the difference per position, the exact McNemar p-value, and paired bootstrap
        intervals of the mean and gap differences. Other runs are drawn side by side with a note
        naming the differing settings; a run that tuned on the compared records is not paired.

        With --html, one page to browse: per position the cells of every run side by side, each
        opening to the prompt its model read (gold passage highlighted), its answer, the gold
        answers and the score, with filters (right only in run A or B, by flag); a judge run's
        pairs with both orders side by side."""
        from ragfix.eval.compare import (
            compare_loaded,
            comparison_tables,
            load_runs,
            write_comparison,
        )
        from ragfix.eval.html_report import is_judge_run, load_judge_run, write_html_report
        from ragfix.eval.results import write_benchmark
        from ragfix.judge.report import judge_comparison, judge_tables
        from ragfix.tables import markdown_tables, print_tables

        with user_errors():
            conditions = gate_conditions(gate, None)
            judged = {p: is_judge_run(p) for p in runs}
            judges = [load_judge_run(p) for p in runs if judged[p]]
            sweeps = load_runs([p for p in runs if not judged[p]])
            comparison = compare_loaded(sweeps, plot=out, title=title) if sweeps else None
            tables = comparison_tables(comparison) if comparison else []
            tables += [t for j in judges for t in judge_tables(j.summary)]
            names = [p.name for p in runs if judged[p]]
            judged_runs = {n: j.summary for n, j in zip(names, judges, strict=True)}
            records = {n: j.records for n, j in zip(names, judges, strict=True)}
            if len(judges) > 1:
                tables.append(judge_comparison(judged_runs, records))
            if markdown:
                typer.echo(markdown_tables(tables))
            else:
                print_tables(tables, console)
                if comparison:
                    console.print(f"plot: {out}", soft_wrap=True, highlight=False)
            if json_out is not None:
                if comparison is None and len(judges) < 2:
                    raise ConfigError(
                        "--json writes a comparison of sweeps or of two or more judge runs: "
                        "give a sweep run or several judge runs"
                    )
                if comparison is not None:
                    write_comparison(json_out, comparison)
                else:
                    write_benchmark(json_out, judge_comparison(judged_runs, records))
                if not markdown:
                    console.print(f"comparison: {json_out}", soft_wrap=True, highlight=False)
            if html is not None:
                write_html_report(html, sweeps, comparison, judges, title)
                if not markdown:
                    console.print(f"page: {html}", soft_wrap=True, highlight=False)
            if conditions:
                if comparison is None:
                    raise ConfigError("--gate reads a sweep's curve: give a sweep run")
                check_gates(comparison, conditions)

    @app.command("render")
    def render_cmd(
        files: Annotated[list[Path], typer.Argument(help="Markdown files (README.md docs/*.md)")],
        check: Annotated[
            bool, typer.Option("--check", help="write nothing; exit 1 when a file is out of date")
        ] = False,
    ) -> None:
        """Rewrite the tables between `<!-- results:KIND FILE -->` and `<!-- /results -->` from
        the result files under results/ (KIND: curve, merit, paired, comparison, benchmark, ppl
        or judge; FILE relative to the Markdown file)."""
        from ragfix.eval.render import render_files

        with user_errors():
            stale = render_files(files, check=check)
        for p in stale:
            console.print(
                f"{'out of date' if check else 'rewrote'}: {p}", soft_wrap=True, highlight=False
            )
        if check and stale:
            raise typer.Exit(1)
