"""Benchmark: the sweep's three ways of running a sample's cells, on the same cells in one run.

* ``naive``: every cell prefilled from scratch and decoded alone;
* ``prefix reuse``: one cell at a time, the KV cache of the prompt prefix the cells of a sample
  share kept between them (positions last to first, the cache cropped to the common prefix);
* ``prefix + batched``: the cells of a sample together: prefilled one after the other over the
  same cache as ``prefix reuse`` (each after the prefix it shares with the one before: the token
  trie of the cells, each distinct prefix once), then their caches stacked left padded and all
  answers decoded in one batch, each row stopping at its own stop rule
  (:meth:`ragfix.backends.hf.HFBackend._generate_trie`).

With several dtypes (``--dtype float32,bfloat16``) every mode runs in each, over one model
loaded per dtype, and the first dtype's ``naive`` is the reference of every row. The modes (and
dtypes) alternate sample by sample, so they see the same machine load. For each: prefill
tokens, decoded tokens, wall seconds, cells per second, peak memory (resident set on the CPU,
allocated on CUDA), and the correctness labels, the answers and the generated token ids compared
with ``naive`` cell by cell (every cell whose tokens differ is listed, with the first differing
step, in the lines and in ``details["modes"][mode]["token_differences"]``). The last line is the
wall-time ratio of the fastest exact mode (naive's label on every cell) against naive.
``ragfix bench sweep --json results/NAME.json`` keeps the table as a result file (rendered into
the README by ``ragfix render``).

    ragfix bench sweep --data nq-sample --num-docs 10 --limit 2
    ragfix bench sweep --data kv-sample --num-docs 8 --limit 2 --dtype float32,bfloat16
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
    dtypes: tuple[str, ...] = ("auto",),
) -> tuple[TableSpec, dict]:
    """Run the same cells in every mode of :data:`MODES`, in every dtype, and compare them.

    Args:
        data: a Lost-in-the-Middle QA or KV file, or a bundled sample name.
        num_docs: documents (or KV pairs) per prompt; every position is a cell.
        limit: samples (``limit x num_docs`` cells per mode).
        model, device: see :func:`ragfix.backends.load_backend` (the ``vanilla`` backend).
        on_progress: called with a short status line after each sample and mode.
        dtypes: the model's dtypes (``"auto"``, ``"float32"``, ``"bfloat16"`` ...), one model
            loaded per dtype; the first dtype's ``naive`` is the reference every row is compared
            with (labels, answers, tokens).

    Returns:
        ``(table, details)``: the formatted table (one row per dtype and mode) and the raw
        figures (per row, keyed ``mode`` for one dtype and ``mode · dtype`` for several: prefill
        and decoded tokens, wall seconds, peak MiB, cells with the reference's labels, answers
        and tokens; the cells whose tokens differ). The lines end with each dtype's fastest
        exact mode against its ``naive`` and, for several dtypes, each mode's wall time against
        the first dtype's same mode.

    Raises:
        DataError, ModelNotFoundError: bad data or model (one line).
        ConfigError: a dtype named twice.
    """
    from ragfix.backends import load_backend
    from ragfix.bundled import bundled_path
    from ragfix.connectors.litm import load_samples
    from ragfix.eval.sweep import SweepConfig, plan_cells, run_cells
    from ragfix.models.device import dtype_axis, resolve_device
    from ragfix.tasks import task_prompt

    path = bundled_path(data) or Path(data)
    samples = load_samples(path, num_docs, limit)
    dev = resolve_device(device)
    names = dtype_axis(dtypes, dev)
    rows_of = [(mode, name) for name in names for mode in MODES]

    def label(mode: str, name: str) -> str:
        return mode if len(names) == 1 else f"{mode} · {name}"

    loaded = {n: load_backend("vanilla", model=model, device=device, dtype=n) for n in names}
    backend = loaded[names[0]]
    cfg = SweepConfig(
        data=str(path), task=samples[0].task, num_docs=num_docs, model=model, backend="vanilla"
    )
    keys = [label(m, n) for m, n in rows_of]
    records: dict[str, dict] = {k: {} for k in keys}
    # the generated token ids of every cell, per row, by prompt text (records keep only text)
    tokens: dict[str, dict[str, list[int] | None]] = {k: {} for k in keys}
    # one backend per row over its dtype's model, each keeping its own prefix cache between
    # samples as it would over a whole sweep (a shared one would hand a mode the prefix another
    # mode left)
    backends = {
        label(m, n): type(loaded[n])(loaded[n].model, loaded[n].tokenizer) for m, n in rows_of
    }
    for key, b in backends.items():
        b.generate = _recording(b, tokens[key])
    text_of: dict[str, str] = {}
    wall = dict.fromkeys(keys, 0.0)
    peak: dict[str, float | None] = dict.fromkeys(keys)
    for i, s in enumerate(samples):
        cells = plan_cells(cfg, [s], list(range(num_docs)))
        for c in cells:
            text_of[c.cell_id] = backend.format_prompt(
                task_prompt(s, s.passages_with_gold_at(c.position))
            )
        for mode, name in rows_of:
            key = label(mode, name)
            reuse, size = MODES[mode]
            reset_peak(dev)
            t = time.perf_counter()
            run_cells(
                backends[key],
                cells,
                lambda r, k=key: records[k].setdefault(r.cell_id, r),
                prefix_reuse=reuse,
                batch_size=size or len(cells),
            )
            wall[key] += time.perf_counter() - t
            mib = peak_mib(dev)
            if mib is not None:
                peak[key] = max(peak[key] or 0.0, mib)
            if on_progress is not None:
                on_progress(f"sample {i + 1}/{len(samples)}: {key} done")

    reference = keys[0]
    naive = records[reference]
    details: dict = {"data": str(path), "num_docs": num_docs, "samples": len(samples)}
    details.update(model=model, device=str(dev), threads=torch.get_num_threads())
    details.update(dtypes=names, modes={})
    rows, lines = [], []
    for (mode, name), key in zip(rows_of, keys, strict=True):
        recs = records[key]
        same_answer = sum(recs[k].answer == naive[k].answer for k in naive)
        same_label = sum(recs[k].correct == naive[k].correct for k in naive)
        diffs = []
        for k, r in recs.items():
            mine, ref = tokens[key].get(text_of[k]), tokens[reference].get(text_of[k])
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
        mem = "n/a" if peak[key] is None else f"{peak[key]:,.0f}"
        rows.append(
            [
                mode,
                name,
                f"{prefill:,}",
                f"{decoded:,}",
                f"{wall[key]:.1f}",
                f"{len(recs) / wall[key]:.3f}",
                mem,
                f"{same_label}/{len(naive)}",
                f"{same_answer}/{len(naive)}",
                f"{len(naive) - len(diffs)}/{len(naive)}",
            ]
        )
        details["modes"][key] = {
            "mode": mode,
            "dtype": name,
            "prefill_tokens": prefill,
            "decoded_tokens": decoded,
            "wall_s": round(wall[key], 2),
            "peak_mib": peak[key],
            "identical_labels": same_label,
            "identical_answers": same_answer,
            "identical_tokens": len(naive) - len(diffs),
            "token_differences": diffs,
        }
        for d in diffs:
            lines.append(
                f"{key} differs at position {d['position']} of {d['sample_id']} from token "
                f"{d['first_step']}: {d['answer']!r} ({len(d['tokens'] or [])} tokens) vs "
                f"{reference} {d['naive_answer']!r} ({len(d['naive_tokens'] or [])} tokens)"
            )
    for name in names:
        own = records[label("naive", name)]
        exact = [
            m
            for m in MODES
            if m != "naive"
            and all(records[label(m, name)][k].correct == own[k].correct for k in own)
        ]
        best = min(exact, key=lambda m: wall[label(m, name)]) if exact else None
        where = "" if len(names) == 1 else f"{name}: "
        if best is not None:
            ratio = wall[label("naive", name)] / wall[label(best, name)]
            lines.append(f"{where}wall time: {ratio:.2f}x less than naive ({best})")
        else:
            lines.append(f"{where}wall time: no mode gave naive's labels on every cell")
        for mode in MODES if name != names[0] else ():  # the first dtype's are the table's
            mine = tokens[label(mode, name)]
            alike = sum(
                mine.get(text_of[k]) == tokens[label("naive", name)].get(text_of[k]) for k in own
            )
            details["modes"][label(mode, name)]["tokens_as_own_naive"] = alike
            if mode != "naive":
                lines.append(
                    f"{name}: {mode} gives {name} naive's tokens in {alike}/{len(own)} cells"
                )
    if len(names) > 1:
        lines.append(f"labels, answers and tokens compared with {reference}")
    for name in names[1:]:
        for mode in MODES:
            ratio = wall[label(mode, names[0])] / wall[label(mode, name)]
            lines.append(f"{mode}: {name} {ratio:.2f}x less wall time than {names[0]}")
    title = (
        f"sweep modes · {model} · {path.name} · {num_docs} docs · {len(naive)} cells · {dev} "
        f"· {torch.get_num_threads()} threads"
    )
    headers = ["mode", "dtype", "prefill tokens", "decoded tokens", "wall s", "cells/s"]
    headers += ["peak MiB", "labels as naive", "answers as naive", "tokens as naive"]
    return TableSpec(title, headers, rows, lines), details
