"""``ragfix bench``: speed benchmarks that print a table (ratios against the baseline, measured in
one run) and keep it as a result file under ``results/`` (``--json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import console, show_tables, user_errors

bench = typer.Typer(help="Speed benchmarks: a table of ratios measured in one run.")

JsonOpt = Annotated[
    Path | None, typer.Option("--json", help="keep the table as a result file (results/NAME.json)")
]


#: ``--dtype`` of the benchmarks that compare dtypes in one run
DtypeAxisOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="the model's dtypes, comma separated (float32,bfloat16: every row in each, "
        "compared with the first)",
    ),
]


def dtype_list(dtype: str) -> tuple[str, ...]:
    """``--dtype``'s comma list as a tuple (``("auto",)`` when empty)."""
    return tuple(d.strip() for d in dtype.split(",") if d.strip()) or ("auto",)


@bench.command("sweep")
def sweep_cmd(
    data: Annotated[str, typer.Option(help="QA or KV file, nq-sample, kv-sample")] = "nq-sample",
    num_docs: Annotated[int, typer.Option(help="documents (or KV pairs) per prompt")] = 10,
    limit: Annotated[int, typer.Option(help="samples (x num-docs cells per mode)")] = 2,
    model: Annotated[str, typer.Option(help="model (vanilla backend)")] = "smollm2",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda ...")] = "auto",
    dtype: DtypeAxisOpt = "auto",
    json_out: JsonOpt = None,
) -> None:
    """The same sweep cells naive, with KV-cache prefix reuse, and with prefix reuse then the
    answers of a sample decoded in one batch, in each dtype: tokens, wall time, cells/s, peak
    memory, labels, answers and generated tokens compared with the first dtype's naive."""
    from ragfix.bench.sweep import bench_sweep

    with user_errors(), console.status("benchmark") as status:
        table, details = bench_sweep(
            data, num_docs, limit, model, device, status.update, dtype_list(dtype)
        )
    show_tables(table, details, json_out)


@bench.command("families")
def families_cmd(
    families: Annotated[
        str, typer.Option(help="model families, comma separated (default: all six)")
    ] = "",
    json_out: JsonOpt = None,
) -> None:
    """Which backend runs on which model family: every backend on a tiny random-config model
    of each family, fp32 and bf16, sdpa and eager, through every generation and scoring path."""
    from ragfix.eval.families import FAMILIES, bench_families

    with user_errors(), console.status("benchmark") as status:
        chosen = [f.strip() for f in families.split(",") if f.strip()] or list(FAMILIES)
        unknown = sorted(set(chosen) - set(FAMILIES))
        if unknown:
            from ragfix.errors import ConfigError

            raise ConfigError(f"unknown families {unknown}; choose from: {', '.join(FAMILIES)}")
        table, details = bench_families(chosen, status.update)
    show_tables(table, details, json_out)


@bench.command("gpu")
def gpu_cmd(
    out: Annotated[Path, typer.Option(help="folder of the result files")] = Path("results"),
    runs: Annotated[Path, typer.Option(help="folder of the sweeps' run folders")] = Path(
        "runs/gpu"
    ),
    device: Annotated[str, typer.Option(help="cuda, cuda:1 ... (cpu: a dry run)")] = "cuda",
    records: Annotated[str, typer.Option(help="held-out KV-8 records START:END")] = "200:230",
    select: Annotated[
        str | None, typer.Option("-k", help="pytest -k expression narrowing the tests")
    ] = None,
) -> None:
    """The check of a CUDA machine in one command: the family mechanism tests on the device
    (bf16 and fp32) and SmolLM2's held-out KV-8 sweep with vanilla, attention-sort and pine,
    each writing a result file (results/gpu-*.json)."""
    from ragfix.bench.gpu import gpu_check
    from ragfix.eval.compare import comparison_tables
    from ragfix.tables import print_tables

    with user_errors(), console.status("gpu check") as status:
        result = gpu_check(
            out, runs, device=device, records=records, select=select, progress=status.update
        )
    m = result["mechanism"]
    console.print(
        f"mechanism tests on {m['device']}: {m['passed']} passed, {m['failed']} failed, "
        f"{m['skipped']} skipped",
        highlight=False,
    )
    for failure in m["failures"]:
        console.print(f"  failed: {failure}", highlight=False, soft_wrap=True)
    print_tables(comparison_tables(result["comparison"]), console)
    console.print(f"result files: {out}/gpu-mechanism.json, {result['path']}", highlight=False)
    if m["failed"]:
        raise typer.Exit(1)


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
    from ragfix.bench.threads import bench_threads
    from ragfix.cli.common import parse_numbers

    with user_errors(), console.status("benchmark") as status:
        t = parse_numbers(threads, "--threads", int)
        b = parse_numbers(busy, "--busy", int)
        table, details = bench_threads(t, b, limit, num_docs, status.update)
    show_tables(table, details, json_out)


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
    from ragfix.bench.scaleout import bench_processes, parse_settings

    with user_errors(), console.status("benchmark") as status:
        table, details = bench_processes(
            parse_settings(settings), data, num_docs, limit, model, status.update
        )
    show_tables(table, details, json_out)


@bench.command("band")
def band_cmd(
    model: Annotated[str, typer.Option(help="a model with sliding-window layers")] = "gemma3-270m",
    lengths: Annotated[str, typer.Option(help="prompt lengths in tokens, comma separated")] = (
        "1000,2000,3500"
    ),
    rows: Annotated[str, typer.Option(help="query rows per block, comma separated")] = (
        "128,256,512"
    ),
    repeats: Annotated[int, typer.Option(min=1, help="timings per setting (the best is kept)")] = 2,
    device: Annotated[str, typer.Option(help="cpu, cuda ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 ...")] = "auto",
    json_out: JsonOpt = None,
) -> None:
    """A sliding-window model's prefill under SDPA with its layers' masks against banded SDPA
    (each block of query rows against the keys its window allows), per length and rows per
    block: seconds, speed-up and the last token's logits against SDPA's."""
    from ragfix.bench.band import bench_band
    from ragfix.cli.common import parse_numbers

    with user_errors(), console.status("benchmark") as status:
        table, details = bench_band(
            model,
            device,
            dtype,
            parse_numbers(lengths, "--lengths", int),
            parse_numbers(rows, "--rows", int),
            repeats,
            status.update,
        )
    show_tables(table, details, json_out)


@bench.command("gali")
def gali_cmd(
    model: Annotated[str, typer.Option(help="model")] = "smollm2",
    train_window: Annotated[int, typer.Option(help="the trained window L (lowered)")] = 512,
    ratios: Annotated[str, typer.Option(help="lengths as multiples of L, comma separated")] = (
        "1,2,4"
    ),
    query_block: Annotated[int, typer.Option(help="GALI's query block")] = 256,
    chunk_size: Annotated[int | None, typer.Option(help="GALI chunk (default: its own)")] = None,
    local_window: Annotated[int | None, typer.Option(help="GALI W (default: its own)")] = None,
    attn_tokens: Annotated[int | None, typer.Option(help="default: max ratio x L")] = None,
    attn_chunk: Annotated[int | None, typer.Option(help="default: GALI's chunk size")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda ...")] = "cpu",
    data: Annotated[Path, typer.Option(help="JSON Lines of long texts (field 'text')")] = Path(
        "data/needle_paul_graham_essays.jsonl.gz"
    ),
    json_out: JsonOpt = None,
) -> None:
    """GALI prefill time and peak memory against vanilla at several lengths, and one layer's
    blocked attention against the paper's two-full-matrices form (run with
    MALLOC_MMAP_THRESHOLD_=65536 on the CPU)."""
    from ragfix.bench.gali import bench_gali
    from ragfix.cli.common import parse_numbers

    with user_errors(), console.status("benchmark") as status:
        tables, details = bench_gali(
            model,
            train_window,
            parse_numbers(ratios, "--ratios"),
            query_block,
            chunk_size,
            local_window,
            attn_tokens,
            attn_chunk,
            device,
            data,
            status.update,
        )
    show_tables(tables, details, json_out)


@bench.command("methods")
def methods_cmd(
    backends: Annotated[
        str, typer.Option(help="backends, comma separated (vanilla, the baseline, always runs)")
    ] = "vanilla,set-based,pine",
    num_docs: Annotated[str, typer.Option(help="passages per prompt, comma separated")] = "10,20",
    limit: Annotated[int, typer.Option(help="prompts (median over them)")] = 3,
    model: Annotated[str, typer.Option(help="model")] = "smollm2",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda ...")] = "auto",
    data: Annotated[str, typer.Option(help="KV or QA file, kv-sample, nq-sample")] = (
        "data/litm_kv_retrieval_140_keys.jsonl.gz"
    ),
    orders: Annotated[
        int | None,
        typer.Option(help="also vanilla answering over K orders of the passages (--orders K)"),
    ] = None,
    orders_aggregate: Annotated[
        str | None,
        typer.Option(
            help="--orders: the aggregators to measure, comma separated (default: the "
            "default aggregator)"
        ),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(help="the task the records are read as (default: qa or kv as the file)"),
    ] = None,
    repeat: Annotated[
        str | None,
        typer.Option(
            help="also vanilla reading the passages or the whole prompt twice: passages, "
            "prompt (comma separated)"
        ),
    ] = None,
    dtype: DtypeAxisOpt = "auto",
    json_out: JsonOpt = None,
) -> None:
    """Prefill time, 8-token generation time, decode time per token and prefill peak memory of
    each backend against vanilla on the same prompts, gold passage in the middle, in each dtype
    (run with MALLOC_MMAP_THRESHOLD_=65536 on the CPU). --json is rewritten after each number of
    passages: a run cut short keeps those it finished."""

    from ragfix.bench.methods import bench_methods
    from ragfix.cli.common import parse_numbers
    from ragfix.eval.results import write_benchmark

    with user_errors(), console.status("benchmark") as status:
        table, details = bench_methods(
            [b.strip() for b in backends.split(",") if b.strip()],
            parse_numbers(num_docs, "--num-docs", int),
            limit,
            model,
            device,
            data,
            status.update,
            orders,
            [a.strip() for a in orders_aggregate.split(",") if a.strip()]
            if orders_aggregate
            else None,
            task,
            [m.strip() for m in repeat.split(",") if m.strip()] if repeat else None,
            None
            if json_out is None
            else lambda tables, details: write_benchmark(json_out, tables, **details),
            dtype_list(dtype),
        )
    show_tables(table, details, json_out, keep_all=True)


@bench.command("channel-scaling")
def channel_scaling_cmd(
    model: Annotated[str, typer.Option(help="model")] = "smollm2",
    device: Annotated[str, typer.Option(help="cpu, cuda ...")] = "cpu",
    data: Annotated[str, typer.Option(help="QA file or nq-sample")] = "nq-sample",
    num_docs: Annotated[int, typer.Option(help="documents per prompt")] = 10,
    prompts: Annotated[int, typer.Option(help="prompts (gold passage first)")] = 4,
    new_tokens: Annotated[int, typer.Option(help="greedy decode steps per prompt")] = 32,
    repeats: Annotated[int, typer.Option(help="runs per prompt and mode (median)")] = 3,
    calibration: Annotated[
        str | None, typer.Option(help="calibration JSON (default: channel 0)")
    ] = None,
    clock: Annotated[str, typer.Option(help="wall or cpu (the process's CPU time)")] = "wall",
    json_out: JsonOpt = None,
) -> None:
    """Prefill time and decode speed of channel-scaled against vanilla on the same prompts (one
    model, patched and unpatched in turn)."""
    from ragfix.bench.channel_scaling import bench_channel_scaling

    with user_errors(), console.status("benchmark") as status:
        table, details = bench_channel_scaling(
            model, device, data, num_docs, prompts, new_tokens, repeats, calibration, clock,
            status.update,
        )  # fmt: skip
    show_tables(table, details, json_out)


@bench.command("remote")
def remote_cmd(
    model: Annotated[str, typer.Option(help="model (local, and served by ragfix serve)")] = (
        "smollm2"
    ),
    prompts: Annotated[int, typer.Option(help="KV prompts")] = 16,
    num_docs: Annotated[int, typer.Option(help="KV pairs per prompt")] = 4,
    concurrency: Annotated[str, typer.Option(help="requests in flight, comma separated")] = "1,2,4",
    json_out: JsonOpt = None,
) -> None:
    """Requests/s of the same prompts through the local backend and through `ragfix serve` at
    several client concurrencies, with the answers compared."""
    from ragfix.bench.remote import bench_remote
    from ragfix.cli.common import parse_numbers

    with user_errors(), console.status("benchmark") as status:
        levels = parse_numbers(concurrency, "--concurrency", int)
        table, details = bench_remote(model, prompts, num_docs, levels, status.update)
    show_tables(table, details, json_out)


@bench.command("lora-gguf")
def lora_gguf_cmd(
    adapter: Annotated[Path, typer.Argument(help="LoRA adapter folder")],
    model: Annotated[str, typer.Option(help="the base model")] = "smollm2",
    base_gguf: Annotated[
        Path | None, typer.Option(help="the GGUF llama.cpp reads (default: the model's own)")
    ] = None,
    prompts: Annotated[int, typer.Option(min=1, help="KV prompts")] = 8,
    num_docs: Annotated[int, typer.Option(min=1, help="KV pairs per prompt")] = 8,
    data: Annotated[Path | None, typer.Option(help="KV file (default: the bundled sample)")] = None,
    records: Annotated[
        str | None, typer.Option(help="record range START:END of --data (held-out records)")
    ] = None,
    merged_type: Annotated[
        str, typer.Option(help="the merged GGUF's merged tensors: f32, f16 or q8_0")
    ] = "f16",
    json_out: JsonOpt = None,
) -> None:
    """The exported GGUF LoRA and merged GGUF in llama.cpp (llama-cpp-python) against the
    adapter in ragfix: next-token log-probabilities, the adapter's shift (with a wrong-row-order
    control) and greedy answers."""
    from ragfix.bench.lora_gguf import bench_lora_gguf

    with user_errors(), console.status("check") as status:
        tables, details = bench_lora_gguf(
            adapter, model, base_gguf, prompts, num_docs, data, records, merged_type, status.update
        )
    show_tables(tables, details, json_out, keep_all=True)


@bench.command("serve")
def serve_cmd(
    model: Annotated[str, typer.Option(help="model served by ragfix serve (on the CPU)")] = (
        "smollm2"
    ),
    clients: Annotated[
        str, typer.Option(help="concurrent clients, comma separated (1, the reference, always)")
    ] = "1,4,8,16",
    requests: Annotated[int, typer.Option(min=1, help="short-prompt requests per level")] = 32,
    long_requests: Annotated[
        int, typer.Option(min=1, max=60, help="long-prompt requests per level")
    ] = 16,
    burst_clients: Annotated[
        int, typer.Option(min=1, help="good clients during the burst of bad requests")
    ] = 8,
    burst_rounds: Annotated[int, typer.Option(min=1, help="rounds of every bad request")] = 4,
    max_seconds: Annotated[
        float, typer.Option(min=1, help="no request starts later in a level; request timeout")
    ] = 300.0,
    max_batch_size: Annotated[
        int | None, typer.Option(min=1, help="ragfix serve --max-batch-size (its default)")
    ] = None,
    max_wait_ms: Annotated[
        float | None, typer.Option(min=0, help="ragfix serve --max-wait-ms (its default)")
    ] = None,
    dtype: DtypeAxisOpt = "auto",
    json_out: JsonOpt = None,
) -> None:
    """A bounded load test of `ragfix serve` on 127.0.0.1: requests/s, p50/p95 latency and
    answers against the sequential ones, for short prompts at several client counts, during a
    burst of malformed and oversized requests, and for long prompts (a second table); with
    several dtypes, a server in each, one after the other, and their requests/s side by side."""
    from ragfix.bench.serve import bench_serve
    from ragfix.cli.common import parse_numbers

    with user_errors(), console.status("benchmark") as status:
        levels = parse_numbers(clients, "--clients", int)
        tables, details = bench_serve(
            model, levels, requests, long_requests, burst_clients, burst_rounds, max_seconds,
            max_batch_size, max_wait_ms, dtype_list(dtype), status.update,
        )  # fmt: skip
    show_tables(tables, details, json_out, keep_all=True)


def register(app: typer.Typer) -> None:
    """Add ``ragfix bench`` to ``app``."""
    app.add_typer(bench, name="bench")
