"""Benchmark of the ``channel-scaled`` backend: prefill time and greedy decode speed against
vanilla on the same prompts, in one run (one model, patched and unpatched in turn).

Run: ``ragfix bench channel-scaling --prompts 4 --new-tokens 32`` (prints one table;
``--json results/NAME.json`` also keeps it as a result file, rendered by ``ragfix render``).
The prompts are Lost-in-the-Middle multi-document QA prompts (gold passage first) from
``--data`` (default: the bundled ``nq-sample``, the first 60 questions of
``derived_nq_20docs_bm25pool_gold_at_0`` cut to 10 documents). For every prompt, vanilla and
channel-scaled run alternately (``--repeats`` times each, after one warm-up); each figure is the
median. Prefill is one forward over the prompt; decode is a greedy loop of ``--new-tokens``
single-token forwards over the KV cache, so tokens/s excludes the prefill.

``--clock cpu`` times with the process's CPU time instead of the wall clock: on a shared CPU
machine the wall clock mostly measures the other jobs; with one thread (``OMP_NUM_THREADS=1``)
CPU seconds are the work done.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ragfix.backends import load_backend
from ragfix.backends.channel_scaling import ChannelScalingBackend, apply_channel_scaling
from ragfix.bundled import resolve_data
from ragfix.connectors.litm import load_samples
from ragfix.errors import ConfigError
from ragfix.tables import TableSpec
from ragfix.tasks import task_prompt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@torch.no_grad()
def time_prompt(model, ids: list[int], new_tokens: int, clock=time.perf_counter):
    """Prefill ``ids`` and decode ``new_tokens`` greedily, timed with ``clock``.

    Returns:
        ``(prefill seconds, decode tokens per second)``.
    """
    dev = next(model.parameters()).device
    x = torch.tensor([ids], device=dev)
    _sync(dev)
    start = clock()
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    _sync(dev)
    prefill = clock() - start
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    start = clock()
    for _ in range(new_tokens):
        out = model(input_ids=token, cache=cache, logits_to_keep=1)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    _sync(dev)
    return prefill, new_tokens / (clock() - start)


def bench_channel_scaling(
    model: str = "smollm2",
    device: str = "cpu",
    data: str = "nq-sample",
    num_docs: int = 10,
    prompts: int = 4,
    new_tokens: int = 32,
    repeats: int = 3,
    calibration: str | None = None,
    clock: str = "wall",
    progress: Callable[[str], object] = lambda _: None,
) -> tuple[TableSpec, dict]:
    """Prefill seconds and decode tokens/s of ``channel-scaled`` (``calibration``, default:
    channel 0) against vanilla, on the first ``prompts`` QA prompts of ``data`` with
    ``num_docs`` documents: the median of ``repeats`` alternating runs each, ``new_tokens``
    greedy decode steps, timed by ``clock`` (``wall`` or ``cpu``). ``progress`` gets one line
    per prompt.

    Returns:
        ``(table, details)``: ``details`` = ``{"measurements": one row per prompt,
        "calibration": calibration}``.

    Raises:
        ConfigError: an unknown ``clock``.
    """
    if clock not in CLOCKS:
        raise ConfigError(f"--clock {clock!r}: one of {', '.join(sorted(CLOCKS))}")
    clock_name, n_prompts, model_name = clock, prompts, model
    vanilla = load_backend("vanilla", model=model, device=device)
    model = vanilla.model
    opts = {"calibration": calibration} if calibration else {"channel": 0}
    scaling = ChannelScalingBackend(model, vanilla.tokenizer, **opts).scaling
    scaling.remove()  # applied only around the channel-scaled runs below
    st = scaling.state

    def run_scaled(ids):
        with apply_channel_scaling(model, st.channel, st.layers, st.factor):
            return time_prompt(model, ids, new_tokens, clock)

    clock = CLOCKS[clock_name]
    samples = load_samples(resolve_data(data), num_docs, limit=n_prompts)
    prompts = [vanilla.encode(task_prompt(s, s.passages_with_gold_at(0))) for s in samples]
    time_prompt(model, prompts[0], 4)  # warm-up
    run_scaled(prompts[0])
    rows = []
    for ids in prompts:
        v, c = [], []
        for _ in range(repeats):
            v.append(time_prompt(model, ids, new_tokens, clock))
            c.append(run_scaled(ids))
        row = {
            "prompt_tokens": len(ids),
            "vanilla_prefill_s": statistics.median(x[0] for x in v),
            "scaled_prefill_s": statistics.median(x[0] for x in c),
            "vanilla_decode_tok_s": statistics.median(x[1] for x in v),
            "scaled_decode_tok_s": statistics.median(x[1] for x in c),
        }
        row["prefill_ratio"] = row["scaled_prefill_s"] / row["vanilla_prefill_s"]
        row["decode_ratio"] = row["scaled_decode_tok_s"] / row["vanilla_decode_tok_s"]
        rows.append(row)
        progress(
            f"{len(ids)} tokens: prefill x{row['prefill_ratio']:.2f}, "
            f"decode x{row['decode_ratio']:.2f}"
        )

    keys = ["vanilla_prefill_s", "scaled_prefill_s", "prefill_ratio"]
    keys += ["vanilla_decode_tok_s", "scaled_decode_tok_s", "decode_ratio"]
    fmt = [".3f", ".3f", ".2f", ".1f", ".1f", ".2f"]
    mean = {k: statistics.mean(r[k] for r in rows) for k in keys}
    table = TableSpec(
        f"channel-scaled vs vanilla, {model_name} on {vanilla.device} "
        f"(channel {st.channel}, layers {st.layers[0]}-{st.layers[-1]}, "
        f"{new_tokens} decode tokens, median of {repeats}, {clock_name} clock)",
        ["prompt tokens", "prefill s vanilla", "prefill s scaled", "prefill ratio"]
        + ["decode tok/s vanilla", "decode tok/s scaled", "decode ratio"],
        [
            [str(r["prompt_tokens"]), *(f"{r[k]:{f}}" for k, f in zip(keys, fmt, strict=True))]
            for r in rows
        ]
        + [["mean", *(f"{mean[k]:{f}}" for k, f in zip(keys, fmt, strict=True))]],
        [f"{torch.get_num_threads()} torch thread(s); ratios: scaled / vanilla"],
    )
    return table, {"measurements": rows, "calibration": calibration}
