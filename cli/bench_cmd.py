"""``ragfix bench``: speed benchmarks that print a table (ratios against the baseline, measured in
one run) and keep it as a result file under ``results/`` (``--json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import console, user_errors

bench = typer.Typer(help="Speed benchmarks: a table of ratios measured in one run.")

JsonOpt = Annotated[
    Path | None, typer.Option("--json", help="keep the table as a result file (results/NAME.json)")
]


def _show(table, details: dict, json_out: Path | None) -> None:
    from ragfix.eval.results import write_benchmark
    from ragfix.tables import print_tables

    print_tables([table], console)
    if json_out is not None:
        write_benchmark(json_out, table, **details)
        console.print(f"result file: {json_out}", highlight=False, soft_wrap=True)


@bench.command("sweep")
def sweep_cmd(
    data: Annotated[str, typer.Option(help="QA or KV file, nq-sample, kv-sample")] = "nq-sample",
    num_docs: Annotated[int, typer.Option(help="documents (or KV pairs) per prompt")] = 10,
    limit: Annotated[int, typer.Option(help="samples (x num-docs cells per mode)")] = 2,
    model: Annotated[str, typer.Option(help="model (vanilla backend)")] = "smollm2",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda ...")] = "auto",
    json_out: JsonOpt = None,
) -> None:
    """The same sweep cells naive, with KV-cache prefix reuse, and with prefix reuse then the
    answers of a sample decoded in one batch: tokens, wall time, cells/s, peak memory, labels,
    answers and generated tokens compared with naive."""
    from ragfix.eval.bench_sweep import bench_sweep

    with user_errors(), console.status("benchmark") as status:
        table, details = bench_sweep(data, num_docs, limit, model, device, status.update)
    _show(table, details, json_out)


@bench.command("threads")
def threads_cmd(
    threads: Annotated[str, typer.Option(help="torch thread counts, comma separated")] = "1,2",
    busy: Annotated[str, typer.Option(help="busy processes beside it, comma separated")] = "0,1",
    limit: Annotated[int, typer.Option(help="KV samples (x num-docs cells per setting)")] = 1,
    num_docs: Annotated[int, typer.Option(help="KV pairs per prompt")] = 8,
    json_out: JsonOpt = None,
) -> None:
    """Seconds per sweep cell for torch thread counts, on an idle machine and beside busy
    processes (each setting in a fresh process)."""
    from ragfix.cli.common import parse_numbers
    from ragfix.eval.bench_threads import bench_threads

    with user_errors(), console.status("benchmark") as status:
        t = parse_numbers(threads, "--threads", int)
        b = parse_numbers(busy, "--busy", int)
        table, details = bench_threads(t, b, limit, num_docs, status.update)
    _show(table, details, json_out)


@bench.command("processes")
def processes_cmd(
    settings: Annotated[
        str,
        typer.Option(
            help="MODE:PxT items, comma separated: naive or batched, P worker processes of T "
            "torch threads each; the first is the baseline"
        ),
    ] = "naive:1x2,batched:1x2,batched:2x1",
    data: Annotated[str, typer.Option(help="QA or KV file, nq-sample, kv-sample")] = "nq-sample",
    num_docs: Annotated[int, typer.Option(help="documents (or KV pairs) per prompt")] = 10,
    limit: Annotated[int, typer.Option(help="samples (x num-docs cells per setting)")] = 2,
    model: Annotated[str, typer.Option(help="model (vanilla backend)")] = "smollm2",
    json_out: JsonOpt = None,
) -> None:
    """The same sweep from scratch in one process or several (``ragfix eval --workers``), each
    setting in a fresh process on the CPU: wall time, cells/s, answers compared with the first."""
    from ragfix.eval.bench_scaleout import bench_processes, parse_settings

    with user_errors(), console.status("benchmark") as status:
        table, details = bench_processes(
            parse_settings(settings), data, num_docs, limit, model, status.update
        )
    _show(table, details, json_out)


def register(app: typer.Typer) -> None:
    """Add ``ragfix bench`` to ``app``."""
    app.add_typer(bench, name="bench")
