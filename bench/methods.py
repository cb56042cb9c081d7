"""Benchmark of method backends against vanilla: prefill time, short-generation time and peak
memory of the prefill, on the same prompts in one run.

Run: ``ragfix bench methods --backends vanilla,set-based,pine --num-docs 10,20 --limit 3``
(prints one table; ``--json results/NAME.json`` keeps it as a result file, rendered by
``ragfix render``). Any registered backend that loads without options can be named
(:func:`ragfix.backends.backend_names`); vanilla, the baseline of the ratios, is always measured
(first) whether named or not.

Prompts: the first ``--limit`` records of ``--data`` (default: the Lost-in-the-Middle KV
retrieval file with 140 keys of ``data/``, relative to the working directory, as in the README's
commands; it is not shipped with the package; a QA file such as
``data/derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz`` or a bundled sample name works too), cut
to each ``--num-docs`` passages with the gold passage in the middle (0-based position
``(num_docs - 1) // 2``), as task prompts that carry their passage spans.

Every backend is loaded once and warmed up with one prefill and one generation of the first
prompt; then the backends take turns prompt by prompt, so that they see the same machine load.
Per prompt and backend, in wall seconds (CUDA synchronised), each call after the backend forgot
what it kept per prompt (:meth:`~ragfix.backends.base.Backend.forget_prompts`: attention-sort's
memoised sort, the prefix KV cache), so that both times are those of a new prompt:

* prefill: ``backend.next_token_logprobs([prompt])``, one forward pass over the whole prompt;
* generate: ``backend.generate([prompt], max_new_tokens=8)``, a prefill and up to 8 greedy
  tokens (the prompt's stop rule applies; the generated counts are in the details);
* peak MiB: growth of memory during the prefill over the memory in use before it
  (:func:`ragfix.bench.memory.measure`): the resident set on the CPU (run with
  ``MALLOC_MMAP_THRESHOLD_=65536``), allocated memory on CUDA;
* decode ms/token: the mean time of one decoding step of batch 1 over the prompt's KV cache,
  :data:`DECODE_STEPS` steps of the backend's step decoder (:meth:`Backend.decoder`:
  ``add`` prefills, each ``step`` decodes one token; greedy, no stop rule but EOS, timed from
  the first step to the last); none for a backend without step decoding
  (:attr:`~ragfix.backends.hf.HFBackend.supports_step_decoding`).

With several dtypes (``--dtype float32,bfloat16``) every backend is loaded in each, its rows
named ``backend · dtype``, and every ratio is to vanilla in the first dtype.

A row is one backend at one number of passages: the median over the prompts of both times, the
largest peak, and the mean of ``len(backend.encode(prompt))`` (a backend's own layout of the
prompt may differ in length from vanilla's). ``×vanilla``: the ratio to vanilla at the same
number of passages. CPU timings beside other jobs are noisy: compare the ratios, not seconds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from ragfix.tables import TableSpec

#: the default ``--data``, relative to the working directory (the repository root)
DATA = "data/litm_kv_retrieval_140_keys.jsonl.gz"
#: the default ``--backends``
BACKENDS = ("vanilla", "set-based", "pine")
#: the default ``--num-docs``
NUM_DOCS = (10, 20)
#: the generation's token budget
NEW_TOKENS = 8
#: decoding steps timed per prompt for ``decode ms/token``
DECODE_STEPS = 32
#: the projection's model: Meta-Llama-3-8B's attention (its config.json: 32 layers, 32 query
#: heads over 8 KV heads of 128 channels), in bf16
LLAMA3_8B = {"name": "Llama-3-8B bf16", "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128}
#: the one tensor of a prefill that grows with the square of the prompt's length ``T``, per
#: backend, as its module computes it (bytes for a model ``shape`` in bf16; absent: none):
#: PINE's passage-to-passage importance (``[H, R, R]`` softmax in float32 per layer, one layer at
#: a time, ``R`` about ``T``); set-based's additive block mask (``[1, 1, T, T]`` in the model's
#: dtype, one per layer type); vanilla, attention-sort (eager only over the question's rows,
#: linear in ``T``) and calibrated-attention (its own attention only over the rows after the
#: passages) have none under sdpa.
QUADRATIC = {
    "pine": ("importance softmax [H, T, T] fp32, one layer", lambda t, m: m["heads"] * t * t * 4),
    "set-based": ("block mask [T, T] bf16", lambda t, m: t * t * 2),
}


def check_backends(names: list[str], model: str = "smollm2") -> list[str]:
    """The backends to measure: ``"vanilla"`` first, then ``names`` in order, each once; checked
    against the registry (and their adapter and remote-model rules) without loading anything.

    Raises:
        ConfigError: an unknown name (one line listing the known ones), an adapter backend, or
            a method backend asked of a remote model.
        pydantic.ValidationError: a backend whose options have no defaults.
    """
    from ragfix.backends import backend_names, validate_backend
    from ragfix.errors import ConfigError

    known = backend_names()
    for name in names:
        if name not in known:
            raise ConfigError(
                f"--backends: unknown backend {name!r}; choose from: {', '.join(known)}"
            )
    chosen = list(dict.fromkeys(["vanilla", *names]))
    for name in chosen:
        validate_backend(name, model=model)
    return chosen


def _ratio(x: float | None, base: float | None) -> float | None:
    return None if x is None or not base else x / base


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else f"{x:{spec}}"


def _measure_prompt(backend, prompt, device: torch.device) -> dict:
    """One prompt on one backend: its token count, the prefill's seconds and peak MiB, the
    generation's seconds and new tokens."""
    from ragfix.bench.memory import measure

    backend.forget_prompts()  # each call pays what a new prompt costs (attention-sort's sort)
    prefill_s, prefill_mib = measure(lambda: backend.next_token_logprobs([prompt]), device)
    backend.forget_prompts()
    gens = []
    generate_s, _ = measure(
        lambda: gens.extend(backend.generate([prompt], max_new_tokens=NEW_TOKENS)), device
    )
    return {
        "prompt_tokens": len(backend.encode(prompt)),
        "prefill_s": prefill_s,
        "generate_s": generate_s,
        "generated_tokens": gens[0].new_tokens,
        "prefill_mib": prefill_mib,
        **_decode_steps(backend, prompt, device),
    }


def _decode_steps(backend, prompt, device: torch.device) -> dict:
    """``decode_ms`` (mean wall milliseconds of one step, CUDA synchronised) and
    ``decode_steps`` (steps timed) of up to :data:`DECODE_STEPS` batch-1 decoding steps after
    the prompt's prefill; both None without step decoding or when the answer ends within one
    step."""
    import time

    none = {"decode_ms": None, "decode_steps": None}
    if not backend.supports_step_decoding:
        return none
    backend.forget_prompts()
    decoder = backend.decoder()
    row = decoder.add(prompt, max_new_tokens=DECODE_STEPS + 1, stop_at_newline=False)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start, done, calls = time.perf_counter(), {}, 0
    while row not in done:
        done.update(decoder.step())
        calls += 1
    sync()
    seconds = time.perf_counter() - start
    answer = done[row]
    if isinstance(answer, Exception):
        raise answer
    # every call ran one forward pass, unless the first token ended the answer: then the one
    # call handed it back without one (a single call is not timed either way)
    if calls < 2:
        return none
    return {"decode_ms": seconds / calls * 1000, "decode_steps": calls}


def bench_methods(
    backends: list[str] | None = None,
    num_docs: list[int] | None = None,
    limit: int = 3,
    model: str = "smollm2",
    device: str = "auto",
    data: str | Path = DATA,
    progress: Callable[[str], object] = lambda _: None,
    orders: int | None = None,
    aggregates: list[str] | None = None,
    task: str | None = None,
    repeats: list[str] | None = None,
    finished: Callable[[list[TableSpec], dict], object] | None = None,
    dtypes: tuple[str, ...] = ("auto",),
) -> tuple[list[TableSpec], dict]:
    """Prefill seconds, generation seconds and prefill peak MiB of ``backends`` (default
    :data:`BACKENDS`; vanilla always, first) at each of ``num_docs`` passages (default
    :data:`NUM_DOCS`), on the first ``limit`` prompts of ``data`` (a Lost-in-the-Middle KV or QA
    file, or a bundled sample name), gold passage in the middle
    (``parse_positions("middle")``). ``model`` and ``device`` are
    :func:`ragfix.backends.load_backend`'s. ``progress`` gets one line per prompt and number of
    passages. With ``orders`` K, one more row per aggregator of ``aggregates`` (default: the
    default aggregator): vanilla under order marginalization (:mod:`ragfix.backends.orders`,
    the default design), named ``vanilla --orders K --orders-aggregate A``; its prefill is one
    order's (the wrapper reads scores from the
    wrapped backend), its generation answers all K orders in one batch without prefix reuse
    (an upper bound on what a sweep, which reuses shared prefixes, pays), the scoring of a
    scoring aggregator's candidates included. ``task`` reads the records as that task
    (:func:`ragfix.tasks.get_task`; default ``qa`` or ``kv`` as the file); each mode of
    ``repeats`` (``passages``, ``prompt``) adds a row of vanilla reading that task's repeated
    prompts (:func:`ragfix.tasks.repeated`), named ``vanilla --repeat MODE``. ``finished``, when
    given, is called with the tables and details of the passage counts measured so far after
    each one (``details["num_docs_done"]``), so that a long benchmark cut short keeps them.
    ``dtypes``: the model's dtypes (:func:`~ragfix.models.device.dtype_axis`); with several,
    every backend is loaded in each, named ``backend · dtype``, and the ratios are to vanilla
    in the first.

    Returns:
        ``(table, details)``: one row per (number of passages, backend), in that order;
        ``details`` = ``{"data", "model", "device", "dtypes", "threads", "limit", "new_tokens",
        "measurements"}``, a measurement per row with its per-prompt figures (``prompt_tokens``,
        ``prefill_s``, ``generate_s``, ``generated_tokens``, ``prefill_mib``, ``decode_ms``,
        ``decode_steps``: lists in prompt order), its ``method`` and ``dtype``, the row's figures
        (``prompt_tokens_mean``, ``prefill_s_median``, ``generate_s_median``, ``peak_mib``,
        ``decode_ms_median``) and their ratios to vanilla (``prefill_x``, ``generate_x``,
        ``peak_x``, ``decode_x``; ``None`` where a figure is unknown or vanilla's is 0).

    Raises:
        ConfigError: an unknown backend, one that needs an adapter, ``limit`` below 1,
            ``orders`` below 2, ``aggregates`` without ``orders``, an unknown task or
            repetition, a task of the other data format, an unknown dtype or one named twice,
            ``orders`` or ``repeats`` with several dtypes (before the model is loaded).
        pydantic.ValidationError: a backend whose options have no defaults, or an unknown
            aggregator (likewise).
        DataError: a missing or malformed data file, or too few passages for ``num_docs``.
        ModelNotFoundError: the model cannot be found.
    """
    from ragfix.backends import backend_class, load_backend
    from ragfix.bundled import resolve_data
    from ragfix.connectors.litm import detect_format, load_samples
    from ragfix.errors import ConfigError
    from ragfix.eval.sweep import parse_positions
    from ragfix.models.device import dtype_axis, resolve_device
    from ragfix.tasks import repeated, resolve_task

    names = check_backends(list(backends or BACKENDS), model)
    if limit < 1:
        raise ConfigError(f"--limit {limit}: must be at least 1")
    dev = resolve_device(device)
    kinds = dtype_axis(dtypes, dev)
    if len(kinds) > 1 and (orders is not None or repeats):
        raise ConfigError("--orders and --repeat are measured in one dtype: give one --dtype")
    marginal = []
    if aggregates and orders is None:
        raise ConfigError("--orders-aggregate is a setting of --orders K: give --orders too")
    if orders is not None:
        from ragfix.backends.orders import OrderOptions, marginalize_orders

        if orders < 2:
            raise ConfigError(f"--orders {orders}: must be at least 2")
        hows = aggregates or [OrderOptions.model_fields["aggregate"].default]
        marginal = [
            (
                f"vanilla --orders {orders} --orders-aggregate {how}",
                OrderOptions(orders=orders, aggregate=how),
            )
            for how in hows
        ]
    counts = list(num_docs or NUM_DOCS)
    path = resolve_data(data)
    reads = bool(marginal) or any(backend_class(n, model).needs_passage_spans for n in names)
    task_read = resolve_task(task, "none", detect_format(path), reads_passages=reads)
    tasks = {name: task_read for name in names}
    for mode in repeats or []:
        tasks[f"vanilla --repeat {mode}"] = repeated(task_read, mode)
    samples = {n: load_samples(path, n, limit) for n in counts}
    prompts = {
        n: {
            name: [
                t.prompt(s.question, s.passages_with_gold_at(parse_positions("middle", n)[0]))
                for s in samples[n]
            ]
            for name, t in tasks.items()
        }
        for n in counts
    }
    loaded, method_of, dtype_of = {}, {}, {}
    for kind in kinds:
        for name in names:
            label = name if len(kinds) == 1 else f"{name} · {kind}"
            progress(f"loading {label}")
            loaded[label] = load_backend(name, model=model, device=device, dtype=kind)
            method_of[label], dtype_of[label] = name, kind
            for n in counts:
                prompts[n][label] = prompts[n][name]
    names = list(loaded)
    for label, options in marginal:  # over the vanilla already loaded: its weights, loaded once
        loaded[label] = marginalize_orders(loaded["vanilla"], options)
        tasks[label] = task_read
        names = [*names, label]
        for n in counts:
            prompts[n][label] = prompts[n]["vanilla"]
    for mode in repeats or []:  # a repeated prompt is read by the vanilla backend
        loaded[f"vanilla --repeat {mode}"] = loaded["vanilla"]
        names = [*names, f"vanilla --repeat {mode}"]
    measured = len(samples[counts[0]])
    for name, b in loaded.items():
        progress(f"warm-up: {name}")
        first = prompts[counts[0]][name][0]
        b.next_token_logprobs([first])
        b.generate([first], max_new_tokens=NEW_TOKENS)

    keys = ("prompt_tokens", "prefill_s", "generate_s", "generated_tokens", "prefill_mib")
    keys += ("decode_ms", "decode_steps")
    settings = {"model": model, "path": path, "task_read": task_read, "dev": dev, "limit": limit}
    settings["dtypes"] = kinds
    rows = []
    for n in counts:
        cells = {name: {k: [] for k in keys} for name in names}
        for i in range(len(samples[n])):
            for name, b in loaded.items():
                for k, v in _measure_prompt(b, prompts[n][name][i], dev).items():
                    cells[name][k].append(v)
            progress(f"{n} passages: prompt {i + 1}/{len(samples[n])} done")
        for name in names:
            c = cells[name]
            mibs = c["prefill_mib"]
            decode = [x for x in c["decode_ms"] if x is not None]
            rows.append(
                {
                    "backend": name,
                    "method": method_of.get(name, "vanilla"),
                    "dtype": dtype_of.get(name, kinds[0]),
                    "num_docs": n,
                    **c,
                    "prompt_tokens_mean": statistics.mean(c["prompt_tokens"]),
                    "prefill_s_median": statistics.median(c["prefill_s"]),
                    "generate_s_median": statistics.median(c["generate_s"]),
                    "peak_mib": None if None in mibs else max(mibs),
                    "decode_ms_median": statistics.median(decode) if decode else None,
                }
            )
        base = rows[-len(names)]  # vanilla, first dtype
        for r in rows[-len(names) :]:
            r["prefill_x"] = _ratio(r["prefill_s_median"], base["prefill_s_median"])
            r["generate_x"] = _ratio(r["generate_s_median"], base["generate_s_median"])
            r["peak_x"] = _ratio(r["peak_mib"], base["peak_mib"])
            r["decode_x"] = _ratio(r["decode_ms_median"], base["decode_ms_median"])

        if finished is not None and n != counts[-1]:
            done = counts[: counts.index(n) + 1]
            finished(*_methods_tables(list(rows), names, done, settings, measured))
    return _methods_tables(rows, names, counts, settings, measured)


def _methods_tables(
    rows: list[dict],
    names: list[str],
    counts: list[int],
    settings: dict,
    measured: int,
) -> tuple[list[TableSpec], dict]:
    """The benchmark's tables and details from its rows (those of ``counts``, measured on
    ``measured`` prompts each); ``settings``: ``model``, ``path``, ``task_read``, ``dev``,
    ``limit``, ``dtypes`` of :func:`bench_methods`."""
    model, path, task_read, dev = (settings[k] for k in ("model", "path", "task_read", "dev"))
    table = TableSpec(
        f"methods vs vanilla · {model} · {path.name} ({task_read.name}) · gold at the middle "
        f"· {dev} · {torch.get_num_threads()} threads",
        ["backend", "passages", "prompt tokens", "prefill s", "×vanilla", "generate s"]
        + ["×vanilla", "peak MiB", "×vanilla", "decode ms/token", "×vanilla"],
        [
            [
                r["backend"],
                str(r["num_docs"]),
                f"{r['prompt_tokens_mean']:,.0f}",
                f"{r['prefill_s_median']:.3f}",
                _fmt(r["prefill_x"], ".2f"),
                f"{r['generate_s_median']:.3f}",
                _fmt(r["generate_x"], ".2f"),
                _fmt(r["peak_mib"], ",.1f"),
                _fmt(r["peak_x"], ".2f"),
                _fmt(r["decode_ms_median"], ".1f"),
                _fmt(r["decode_x"], ".2f"),
            ]
            for r in rows
        ],
        [
            f"Median of {measured} prompt(s) after a warm-up; prefill: "
            f"next_token_logprobs, one forward pass; generate: up to {NEW_TOKENS} new tokens; "
            "peak: largest growth of the resident set (CPU) or of allocated CUDA memory during "
            f"the prefill; decode: mean of up to {DECODE_STEPS} batch-1 decoding steps after the "
            "prefill (none without step decoding); ×vanilla: ratio to "
            f"{names[0]} at the same number of passages."
        ],
    )
    details = {
        "projection": LLAMA3_8B,
        "data": str(path),
        "task": task_read.name,
        "model": model,
        "device": str(dev),
        "dtypes": settings["dtypes"],
        "threads": torch.get_num_threads(),
        "limit": settings["limit"],
        "num_docs_done": counts,
        "new_tokens": NEW_TOKENS,
        "measurements": rows,
    }
    return [table, growth_table(rows, names, counts)], details


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``log y`` on ``log x`` (``None`` with fewer than two points or a
    figure that is not positive)."""
    import math

    if len(xs) < 2 or min(ys, default=0) <= 0:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.mean(lx), statistics.mean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den if den else None


def growth_table(rows: list[dict], names: list[str], counts: list[int]) -> TableSpec:
    """How each backend's cost grows with the prompt's length, and what that gives for
    :data:`LLAMA3_8B` at the largest number of passages measured.

    Per backend: the exponent ``a`` of prefill seconds ``~ T^a`` (least squares over the
    measured numbers of passages, ``T`` their mean prompt tokens), the prefill ratio to vanilla
    at the largest number, and, for the 8B model at that ``T``: its KV cache (``2 * layers *
    kv_heads * head_dim * T`` values in bf16, every backend) and the backend's tensor that
    grows with ``T^2`` (:data:`QUADRATIC`), computed from the shapes, not measured.
    """
    m = LLAMA3_8B
    top = max(counts)
    out = []
    for name in names:
        mine = [r for r in rows if r["backend"] == name]
        a = _slope([r["prompt_tokens_mean"] for r in mine], [r["prefill_s_median"] for r in mine])
        last = next(r for r in mine if r["num_docs"] == top)
        t = last["prompt_tokens_mean"]
        kv = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * t * 2 / 2**20
        what, size = QUADRATIC.get(last["method"], ("none", None))
        out.append(
            [
                name,
                _fmt(a, ".2f"),
                _fmt(last["prefill_x"], ".2f"),
                f"{t:,.0f}",
                f"{kv:,.0f}",
                what,
                "" if size is None else f"{size(t, m) / 2**20:,.0f}",
            ]
        )
    return TableSpec(
        f"growth with the prompt's length, and {m['name']} at {top} passages (computed)",
        ["backend", "prefill ~ T^a", f"×vanilla at {top}", "T", "KV cache MiB"]
        + ["grows with T^2", "its MiB"],
        out,
        [
            "a: least-squares slope of log prefill seconds on log prompt tokens over the "
            "measured numbers of passages. KV cache and the T^2 tensor: from the 8B model's "
            "shapes (32 layers, 32 heads, 8 KV heads of 128 channels) at the measured T, "
            "bf16; computed, not measured."
        ],
    )
