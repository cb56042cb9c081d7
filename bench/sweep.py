"""Benchmark: the sweep's three ways of running a sample's cells, on the same cells in one run.

* ``naive``: every cell prefilled from scratch and decoded alone;
* ``prefix reuse``: one cell at a time, the KV cache of the prompt prefix the cells of a sample
  share kept between them (positions last to first, the cache cropped to the common prefix);
* ``prefix + batched``: the cells of a sample together: prefilled one after the other over the
  same cache as ``prefix reuse`` (each after the prefix it shares with the one before: the token
  trie of the cells, each distinct prefix once), then their caches stacked left padded and all
  answers decoded in one batch, each row stopping at its own stop rule
  (:meth:`ragfix.backends.hf.HFBackend._generate_trie`).

The modes alternate sample by sample, so they see the same machine load. For each: prefill
tokens, decoded tokens, wall seconds, cells per second, peak memory (resident set on the CPU,
allocated on CUDA), and the correctness labels, the answers and the generated token ids compared
with ``naive`` cell by cell (every cell whose tokens differ is listed, with the first differing
step, in the lines and in ``details["modes"][mode]["token_differences"]``). The last line is the
wall-time ratio of the fastest exact mode (naive's label on every cell) against naive.
``ragfix bench sweep --json results/NAME.json`` keeps the table as a result file (rendered into
the README by ``ragfix render``).

    ragfix bench sweep --data nq-sample --num-docs 10 --limit 2
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ragfix.bench.memory import peak_mib, reset_peak
from ragfix.tables import TableSpec

MODES = {"naive": (False, 1), "prefix reuse": (True, 1), "prefix + batched": (True, None)}


def _recording(backend, into: dict[str, list[int] | None]):
    """``backend.generate`` that also keeps each answer's generated token ids in ``into``, by
    the prompt's text."""
    generate = backend.generate

    def recording(prompts, **kwargs):
        gens = generate(prompts, **kwargs)
        for p, g in zip(prompts, gens, strict=True):
            into[backend.format_prompt(p)] = g.token_ids
        return gens

    return recording


def bench_sweep(
    data: str = "nq-sample",
    num_docs: int = 10,
    limit: int = 2,
    model: str = "smollm2",
    device: str = "auto",
    on_progress=None,
) -> tuple[TableSpec, dict]:
    """Run the same cells in every mode of :data:`MODES` and compare them.

    Args:
        data: a Lost-in-the-Middle QA or KV file, or a bundled sample name.
        num_docs: documents (or KV pairs) per prompt; every position is a cell.
        limit: samples (``limit x num_docs`` cells per mode).
        model, device: see :func:`ragfix.backends.load_backend` (the ``vanilla`` backend).
        on_progress: called with a short status line after each sample and mode.

    Returns:
        ``(table, details)``: the formatted table and the raw figures (per mode: prefill and
        decoded tokens, wall seconds, peak MiB, cells with naive's labels, answers and tokens;
        the cells whose tokens differ).

    Raises:
        DataError, ModelNotFoundError: bad data or model (one line).
    """
    from ragfix.backends import load_backend
    from ragfix.bundled import bundled_path
    from ragfix.connectors.litm import load_samples
    from ragfix.eval.sweep import SweepConfig, plan_cells, run_cells
    from ragfix.models.device import resolve_device
    from ragfix.tasks import task_prompt

    path = bundled_path(data) or Path(data)
    samples = load_samples(path, num_docs, limit)
    backend = load_backend("vanilla", model=model, device=device)
    dev = resolve_device(device)
    cfg = SweepConfig(
        data=str(path), task=samples[0].task, num_docs=num_docs, model=model, backend="vanilla"
    )
    records: dict[str, dict] = {m: {} for m in MODES}
    # the generated token ids of every cell, per mode, by prompt text (records keep only text)
    tokens: dict[str, dict[str, list[int] | None]] = {m: {} for m in MODES}
    # one backend per mode over the same model, each keeping its own prefix cache between
    # samples as it would over a whole sweep (a shared one would hand a mode the prefix another
    # mode left)
    backends = {m: type(backend)(backend.model, backend.tokenizer) for m in MODES}
    for mode, b in backends.items():
        b.generate = _recording(b, tokens[mode])
    text_of: dict[str, str] = {}
    wall = dict.fromkeys(MODES, 0.0)
    peak: dict[str, float | None] = dict.fromkeys(MODES)
    for i, s in enumerate(samples):
        cells = plan_cells(cfg, [s], list(range(num_docs)))
        for c in cells:
            text_of[c.cell_id] = backend.format_prompt(
                task_prompt(s, s.passages_with_gold_at(c.position))
            )
        for mode, (reuse, size) in MODES.items():
            reset_peak(dev)
            t = time.perf_counter()
            run_cells(
                backends[mode],
                cells,
                lambda r, m=mode: records[m].setdefault(r.cell_id, r),
                prefix_reuse=reuse,
                batch_size=size or len(cells),
            )
            wall[mode] += time.perf_counter() - t
            mib = peak_mib(dev)
            if mib is not None:
                peak[mode] = max(peak[mode] or 0.0, mib)
            if on_progress is not None:
                on_progress(f"sample {i + 1}/{len(samples)}: {mode} done")

    naive = records["naive"]
    details: dict = {"data": str(path), "num_docs": num_docs, "samples": len(samples)}
    details.update(model=model, device=str(dev), threads=torch.get_num_threads(), modes={})
    rows, lines = [], []
    for mode, recs in records.items():
        same_answer = sum(recs[k].answer == naive[k].answer for k in naive)
        same_label = sum(recs[k].correct == naive[k].correct for k in naive)
        diffs = []
        for k, r in recs.items():
            mine, ref = tokens[mode].get(text_of[k]), tokens["naive"].get(text_of[k])
            if mine != ref:
                step = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(mine or [], ref or [], strict=False))
                        if a != b
                    ),
                    min(len(mine or []), len(ref or [])),
                )
                diffs.append(
                    {
                        "sample_id": r.sample_id,
                        "position": r.position,
                        "first_step": step,
                        "answer": r.answer,
                        "naive_answer": naive[k].answer,
                        "tokens": mine,
                        "naive_tokens": ref,
                    }
                )
        prefill = sum(r.prefill_tokens for r in recs.values())
        decoded = sum(r.new_tokens for r in recs.values())
        mem = "n/a" if peak[mode] is None else f"{peak[mode]:,.0f}"
        rows.append(
            [
                mode,
                f"{prefill:,}",
                f"{decoded:,}",
                f"{wall[mode]:.1f}",
                f"{len(recs) / wall[mode]:.3f}",
                mem,
                f"{same_label}/{len(naive)}",
                f"{same_answer}/{len(naive)}",
                f"{len(naive) - len(diffs)}/{len(naive)}",
            ]
        )
        details["modes"][mode] = {
            "prefill_tokens": prefill,
            "decoded_tokens": decoded,
            "wall_s": round(wall[mode], 2),
            "peak_mib": peak[mode],
            "identical_labels": same_label,
            "identical_answers": same_answer,
            "identical_tokens": len(naive) - len(diffs),
            "token_differences": diffs,
        }
        for d in diffs:
            lines.append(
                f"{mode} differs at position {d['position']} of {d['sample_id']} from token "
                f"{d['first_step']}: {d['answer']!r} ({len(d['tokens'] or [])} tokens) vs naive "
                f"{d['naive_answer']!r} ({len(d['naive_tokens'] or [])} tokens)"
            )
    exact = [
        m for m in MODES if m != "naive" and details["modes"][m]["identical_labels"] == len(naive)
    ]
    best = min(exact, key=lambda m: wall[m]) if exact else None
    if best is not None:
        lines.append(f"wall time: {wall['naive'] / wall[best]:.2f}x less than naive ({best})")
    else:
        lines.append("wall time: no mode gave naive's labels on every cell")
    title = (
        f"sweep modes · {model} · {path.name} · {num_docs} docs · {len(naive)} cells · {dev} "
        f"· {torch.get_num_threads()} threads"
    )
    headers = ["mode", "prefill tokens", "decoded tokens", "wall s", "cells/s", "peak MiB"]
    headers += ["labels as naive", "answers as naive", "tokens as naive"]
    return TableSpec(title, headers, rows, lines), details
