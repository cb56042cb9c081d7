"""Benchmark: the same KV prompts through the local backend and through ``ragfix serve`` at
several client concurrencies, in one run.

The local backend answers the prompts one at a time (batch 1, KV-cache prefix reuse, as a CPU
sweep does), then is freed; ``ragfix serve`` is started with the same model (prefix reuse on,
requests one at a time through the model) and the remote backend (``openai:NAME``) sends the
same prompts with 1, 2, 4 ... requests in flight. Only one model is loaded at a time. Each mode
gets one warm-up request first. Prints requests/s, the ratio to local and how many answers equal
the local ones; ``--json`` keeps the figures as a result file.

    ragfix bench remote --prompts 16 --num-docs 4 --json results/remote-throughput.json
"""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable

from ragfix.backends import load_backend
from ragfix.bundled import bundled_path
from ragfix.connectors.litm import load_samples
from ragfix.serve import serving
from ragfix.tables import TableSpec
from ragfix.tasks import task_prompt


def kv_cells(n: int, num_docs: int, data=None, records: str | None = None) -> list[tuple]:
    """``n`` ``(sample, prompt)`` cells of a KV-retrieval file (default: the bundled sample) in
    the record range ``records``: its samples in order, the gold pair at each position in turn.

    Raises:
        ConfigError, DataError: see :func:`~ragfix.connectors.litm.load_samples`.
    """
    samples = load_samples(data or bundled_path("kv-sample"), num_docs, None, records=records)
    cells = [(s, p) for s in samples for p in range(num_docs)][:n]
    return [(s, task_prompt(s, s.passages_with_gold_at(p))) for s, p in cells]


def kv_prompts(n: int, num_docs: int) -> list:
    """The prompts of :func:`kv_cells` of the bundled sample."""
    return [prompt for _, prompt in kv_cells(n, num_docs)]


def _timed(run) -> tuple[list[str], float]:
    start = time.perf_counter()
    answers = run()
    return answers, time.perf_counter() - start


def _local(model: str, prompts: list) -> tuple[list[str], float, int]:
    """Answers, seconds and prompt tokens of ``prompts`` through the local backend, one at a
    time with prefix reuse, after one warm-up answer."""
    local = load_backend("vanilla", model=model, device="cpu")
    local.generate(prompts[:1], batch_size=1)
    answers, secs = _timed(
        lambda: [local.generate([p], batch_size=1, prefix_reuse=True)[0].text for p in prompts]
    )
    return answers, secs, sum(len(local.encode(p)) for p in prompts)


def throughput_table(details: dict) -> TableSpec:
    """The benchmark's table from its figures (``details["measurements"]``: one row per mode,
    local first)."""
    rows = details["measurements"]
    n = details["prompts"]
    return TableSpec(
        f"{details['model']} · {n} KV prompts ({details['num_docs']} pairs, "
        f"{details['prompt_tokens']} prompt tokens) · local backend vs ragfix serve",
        ["mode", "concurrency", "requests/s", "ratio to local", "same answers", "wall s"],
        [
            [
                r["mode"],
                "-" if r["concurrency"] is None else str(r["concurrency"]),
                f"{r['requests_per_s']:.3f}",
                f"{r['ratio_to_local']:.2f}",
                f"{r['same_answers']}/{n}",
                f"{r['seconds']:.1f}",
            ]
            for r in rows
        ],
    )


def bench_remote(
    model: str = "smollm2",
    prompts: int = 16,
    num_docs: int = 4,
    concurrency: list[int] | None = None,
    progress: Callable[[str], object] = lambda _: None,
) -> tuple[TableSpec, dict]:
    """Requests/s of ``prompts`` KV prompts (``num_docs`` pairs) through the local backend,
    then through ``ragfix serve`` at each client ``concurrency`` (default 1, 2, 4), with the
    number of answers equal to the local ones.

    Returns:
        ``(table, details)``: ``details`` holds the model, data, prompt counts, the machine and
        ``measurements`` (one row per mode, local first).
    """
    levels = list(concurrency or (1, 2, 4))
    prompt_list = kv_prompts(prompts, num_docs)
    n_docs = num_docs
    progress("local backend")
    ref, secs, tokens = _local(model, prompt_list)
    gc.collect()  # the local model is gone before the server loads its own
    rows = [{"mode": "local", "concurrency": None, "seconds": secs, "same_answers": len(ref)}]

    with serving("--model", model, "--device", "cpu") as url:
        for c in levels:
            progress(f"ragfix serve, {c} request(s) in flight")
            remote = load_backend("vanilla", model=f"openai:{model}", api_base=url, concurrency=c)
            remote.generate(prompt_list[:1])  # warm-up
            answers, secs = _timed(lambda r=remote: [g.text for g in r.generate(prompt_list)])
            same = sum(a == b for a, b in zip(answers, ref, strict=True))
            rows.append({"mode": "serve", "concurrency": c, "seconds": secs, "same_answers": same})

    base = len(prompt_list) / rows[0]["seconds"]
    for r in rows:
        r["requests_per_s"] = round(len(prompt_list) / r["seconds"], 4)
        r["ratio_to_local"] = round(r["requests_per_s"] / base, 3)
        r["seconds"] = round(r["seconds"], 2)
    details = {
        "model": model,
        "data": "kv-sample",
        "num_docs": n_docs,
        "prompts": len(prompt_list),
        "prompt_tokens": tokens,
        "machine": f"{platform.machine()}, cpu, 1 math thread per process",
        "measurements": rows,
    }
    return throughput_table(details), details
