"""Benchmark of the ``gali`` backend: prefill time and peak memory against vanilla, and the memory
of one layer's blocked attention against the paper's two-full-matrices form.

Run: ``ragfix bench gali --train-window 512`` (prints two tables; ``--json`` keeps the prefill
table as a result file). Lengths are 1x, 2x, 4x the (possibly lowered) trained window ``L``, read
from ``--data`` (default: the Paul Graham essays of ``data/``, relative to the working
directory, as in the README's commands; they are not shipped with the package); each prefill is
timed once after a short warm-up.

Peak memory is the growth of the process's peak resident set (``VmHWM`` of
``/proc/self/status``, reset through ``/proc/self/clear_refs``) over its size before the call on
the CPU (run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the system
and each peak is measured from a clean state), and ``torch.cuda.max_memory_allocated`` growth on
CUDA (:func:`ragfix.bench.memory.measure`). The machine's load makes CPU timings noisy:
compare ratios, not seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import repeat_kv

from ragfix.backends import load_backend
from ragfix.backends.gali import GaliBackend, chunk_sizes, paper_logits, paper_setting
from ragfix.backends.gali.backend import _GaliRun
from ragfix.bench.memory import measure
from ragfix.eval.ppl import read_texts
from ragfix.tables import TableSpec

#: the default ``--data``, relative to the working directory (the repository root)
DATA = "data/needle_paul_graham_essays.jsonl.gz"


def paper_attention(q, k, v, layout, rotary, scaling: float, start: int, generator):
    """One layer's attention as the official code computes it: both logit matrices, a full
    noise matrix, mask, fp32 softmax, ``repeat_kv`` for GQA (the memory reference).

    Args:
        q: ``[B, H, c, d]``; k, v: ``[B, Hkv, T, d]`` (pre-RoPE); start: first query index.
    Returns:
        ``[B, H, c, d]``.
    """
    groups = q.shape[1] // k.shape[1]
    total = k.shape[2]
    logits = paper_logits(q, repeat_kv(k, groups), layout, rotary, scaling, start)
    rows = torch.arange(start, start + q.shape[2])[:, None]
    cols = torch.arange(total)[None, :]
    sigma = (rows - cols).clamp(min=0) / total * (layout.frac > 0).to(q.dtype)
    logits = logits + torch.randn(logits.shape, generator=generator) * sigma
    logits = logits.masked_fill(cols > rows, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
    return probs @ repeat_kv(v, groups)


def bench_gali(
    model: str = "smollm2",
    train_window: int = 512,
    ratios: list[float] | None = None,
    query_block: int = 256,
    chunk_size: int | None = None,
    local_window: int | None = None,
    attn_tokens: int | None = None,
    attn_chunk: int | None = None,
    device: str = "cpu",
    data: str | Path = DATA,
    progress: Callable[[str], object] = lambda _: None,
) -> tuple[list[TableSpec], dict]:
    """Prefill time and peak memory of ``gali`` against vanilla at ``ratios`` (default 1, 2, 4)
    times the trained window ``train_window``, read from the long texts of ``data`` (JSON Lines,
    field ``text``), with the prefill time of GALI at the paper's setting scaled to ``L``
    (:func:`~ragfix.backends.gali.paper_setting`) beside it and the prefill passes of both; then
    one layer's attention over the last chunk of ``attn_tokens`` (default: the longest length) in
    the paper's form and blocked by ``query_block`` and by 32. ``chunk_size`` and
    ``local_window`` are GALI's (default: its own); ``attn_chunk`` defaults to the chunk size.
    ``progress`` gets one line per measured length.

    Returns:
        ``(tables, details)``: the prefill table (the one a result file keeps) and the attention
        table; ``details`` = ``{"measurements": rows (kind ``prefill`` or ``attention``),
        "options": GALI's resolved options, "paper_options": the paper's setting's}``.
    """
    ratios = [float(r) for r in (ratios or (1, 2, 4))]
    vanilla = load_backend("vanilla", model=model, device=device)
    big_l = train_window

    def gali_with(**opts) -> GaliBackend:
        return GaliBackend(
            vanilla.model,
            vanilla.tokenizer,
            train_window=big_l,
            target_window=int(max(ratios) * big_l),
            query_block=query_block,
            **opts,
        )

    chosen = {"chunk_size": chunk_size, "local_window": local_window}
    gali = gali_with(**{k: v for k, v in chosen.items() if v is not None})
    paper = gali_with(**paper_setting(big_l))
    dev = vanilla.device
    text = read_texts(data)[: int(max(ratios) * big_l) * 12]
    tokens = vanilla.tokenize(text)
    warm = tokens[: big_l + 16]
    with torch.no_grad():
        vanilla.model(input_ids=torch.tensor([warm], device=dev), logits_to_keep=1)
        gali.prefill_logits(warm)
        paper.prefill_logits(warm)

    rows = []
    for r in ratios:
        ids = tokens[: int(r * big_l)]
        x = torch.tensor([ids], device=dev)
        with torch.no_grad():
            t_v, m_v = measure(lambda x=x: vanilla.model(input_ids=x, logits_to_keep=1), dev)
            t_g, m_g = measure(lambda ids=ids: gali.prefill_logits(ids), dev)
            t_p, _ = measure(lambda ids=ids: paper.prefill_logits(ids), dev)
        rows.append(
            {
                "kind": "prefill",
                "tokens": len(ids),
                "ratio": r,
                "vanilla_s": t_v,
                "gali_s": t_g,
                "time_ratio": t_g / t_v,
                "gali_passes": len(
                    chunk_sizes(len(ids), big_l, gali.options_resolved["chunk_size"])
                ),
                "paper_s": t_p,
                "paper_time_ratio": t_p / t_v,
                "paper_passes": len(
                    chunk_sizes(len(ids), big_l, paper.options_resolved["chunk_size"])
                ),
                "vanilla_mib": m_v,
                "gali_mib": m_g,
                "mem_ratio": m_g / m_v if m_v else float("nan"),
            }
        )
        progress(
            f"prefill {len(ids)} tokens: vanilla {t_v:.2f}s, gali {t_g:.2f}s, paper {t_p:.2f}s"
        )

    # one layer's attention for the last prefill chunk at the longest length
    cfg = vanilla.model.config
    attn = gali.attentions[0]
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    total = attn_tokens or int(max(ratios) * big_l)
    chunk = attn_chunk or gali.options_resolved["chunk_size"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, chunk, d, generator=g).to(dev)
    k = torch.randn(1, kv_heads, total, d, generator=g).to(dev)
    v = torch.randn(1, kv_heads, total, d, generator=g).to(dev)
    run = _GaliRun(gali)
    run.done = total - chunk
    run.begin(chunk)
    with torch.no_grad():
        t_p, m_p = measure(
            lambda: paper_attention(q, k, v, run.layout, gali.rotary, attn.scaling, run.start, g),
            dev,
        )
        for block in (query_block, 32):
            gali.options = gali.options.model_copy(update={"query_block": block})
            t_b, m_b = measure(lambda: run.attend(attn, q, k, v), dev)
            rows.append(
                {
                    "kind": "attention",
                    "tokens": total,
                    "chunk": chunk,
                    "query_block": block,
                    "paper_s": t_p,
                    "blocked_s": t_b,
                    "paper_mib": m_p,
                    "blocked_mib": m_b,
                }
            )

    opts, popts = gali.options_resolved, paper.options_resolved
    prefill = TableSpec(
        f"GALI prefill vs vanilla, {model}, L = {big_l}, chunk {opts['chunk_size']}, "
        f"local window {opts['local_window']} (paper's setting: chunk {popts['chunk_size']}, "
        f"local window {popts['local_window']}), device {dev}",
        [
            "tokens",
            "x L",
            "vanilla s",
            "gali s",
            "time x",
            "passes",
            "paper's s",
            "time x",
            "passes",
            "vanilla MiB",
            "gali MiB",
        ],
        [
            [
                str(row["tokens"]),
                f"{row['ratio']:g}",
                f"{row['vanilla_s']:.2f}",
                f"{row['gali_s']:.2f}",
                f"{row['time_ratio']:.2f}",
                str(row["gali_passes"]),
                f"{row['paper_s']:.2f}",
                f"{row['paper_time_ratio']:.2f}",
                str(row["paper_passes"]),
                f"{row['vanilla_mib']:.0f}",
                f"{row['gali_mib']:.0f}",
            ]
            for row in rows
            if row["kind"] == "prefill"
        ],
        [
            f"One prefill per length after a warm-up, {torch.get_num_threads()} torch thread(s); "
            "time x: against vanilla; passes: forward passes of the chunked prefill; memory: "
            "growth of the peak resident set (CPU) or of the allocated CUDA memory."
        ],
    )
    attention = TableSpec(
        f"One layer's attention, last chunk of {total} tokens ({heads} heads)",
        ["chunk", "query block", "paper s", "blocked s", "paper MiB", "blocked MiB"],
        [
            [
                str(row["chunk"]),
                str(row["query_block"]),
                f"{row['paper_s']:.3f}",
                f"{row['blocked_s']:.3f}",
                f"{row['paper_mib']:.1f}",
                f"{row['blocked_mib']:.1f}",
            ]
            for row in rows
            if row["kind"] == "attention"
        ],
    )
    return [prefill, attention], {"measurements": rows, "options": opts, "paper_options": popts}
