"""``ragfix report`` (compare runs: figures of merit, paired tests, plot, JSON) and ``ragfix
render`` (rewrite the results tables of Markdown files from ``results/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import console, user_errors


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
    ) -> None:
        """Figures of merit of every curve (mean, worst position, best-worst gap, with 95%
        intervals) and their plot.

        Curves of runs with the same cells (same data, task, number of passages, record range
        and prompt layout; the model, backend or adapter may differ) are compared with the first
        one: the difference per position, the exact McNemar p-value, and paired bootstrap
        intervals of the mean and gap differences. Other runs are drawn side by side with a note
        naming the differing settings; a run that tuned on the compared records is not paired."""
        from ragfix.eval.compare import compare_runs, comparison_tables, write_comparison
        from ragfix.tables import markdown_tables, print_tables

        with user_errors():
            comparison = compare_runs(runs, plot=out, title=title)
            tables = comparison_tables(comparison)
            if markdown:
                typer.echo(markdown_tables(tables))
            else:
                print_tables(tables, console)
                console.print(f"plot: {out}")
            if json_out is not None:
                write_comparison(json_out, comparison)
                if not markdown:
                    console.print(f"comparison: {json_out}")

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
