"""Benchmark: a bounded load test of ``ragfix serve`` on 127.0.0.1 (issue 31, "Measure").

``ragfix serve`` is started for the run (:func:`ragfix.serve.serving`: a subprocess with one
math thread, on a free port of 127.0.0.1, stopped at the end) and ``httpx`` async clients send
it chat requests, greedy, ``max_tokens`` :data:`MAX_TOKENS`, no stop rule:

* short prompts (:func:`short_prompts`: one question each, at most :data:`SHORT_PROMPT_TOKENS`
  tokens in the chat template) from 1, 4, 8 and 16 concurrent clients (closed loop: each client
  sends its next request once its answer is in). Every level sends the same ``requests``
  prompts in the same order; 1 client is the sequential run whose answers every other level is
  compared with (text identical);
* the same at ``burst_clients`` clients while a burst of bad requests runs beside them
  (:func:`bad_requests`: bad JSON, wrong types, a 5 MB body, over-long prompts, an unknown model;
  each kind ``burst_rounds`` times, every round sent at once): no good request may fail or
  change its answer, every bad one must get its own 4xx with an OpenAI error body, and then the
  server must still answer (``/health``, and the first prompt with its sequential answer);
* long, prefill-bound prompts (:func:`long_prompts`: about 400 tokens each, a distinct KV
  sample each) at the same client counts, in a second table, without a target.

With several dtypes (``--dtype float32,bfloat16``) the whole test runs once per dtype, a server
in each, one after the other, and a first table sets their requests/s side by side, with the
sequential answers of each later dtype that are identical to the first's.

Each table's levels start after one warm-up request. A level is bounded in requests
(``requests`` / ``long_requests``) and in time: no client starts a request after
``max_seconds`` from the level's start, and each request times out after ``max_seconds``, so
the run stops by itself. Requests/s counts the answered good requests over the level's wall
time; latency is a request's wall time, send to full answer (p50 and p95, nearest rank).

    ragfix bench serve --json results/serve-load.json
"""

from __future__ import annotations

import asyncio
import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ragfix.bench.remote import kv_prompts
from ragfix.errors import ConfigError
from ragfix.serve import serving
from ragfix.tables import TableSpec

#: answer budget of every request
MAX_TOKENS = 32
#: most prompt tokens (chat template included) of a short prompt
SHORT_PROMPT_TOKENS = 64
#: the subjects of the short prompts (one question each)
TOPICS = (
    "photosynthesis", "gravity", "a rainbow", "a volcano", "democracy", "inflation",
    "a black hole", "DNA", "an earthquake", "the internet", "a vaccine", "electricity",
    "a glacier", "a hurricane", "the moon", "a battery", "a compass", "a telescope", "a desert",
    "a rainforest", "friction", "magnetism", "a tsunami", "a comet", "an atom", "a cell",
    "evaporation", "a bridge", "a calendar", "a library", "a piano", "a windmill",
)  # fmt: skip
#: the target of issue 31: requests/s at 8 short-prompt clients over one client's
TARGET = (8, 3.0)
#: the target of issue 57: requests/s at 8 short-prompt clients in bf16 over float32's
DTYPE_TARGET = (8, 2.0)


def short_prompts(n: int) -> list[dict]:
    """``n`` chat request fields (``messages``) of short questions, one per :data:`TOPICS` entry
    in turn (repeating after ``len(TOPICS)``)."""
    return [
        {"messages": [{"role": "user", "content": f"Explain in one sentence what {t} is."}]}
        for t in (TOPICS[i % len(TOPICS)] for i in range(n))
    ]


def long_prompts(n: int) -> list[dict]:
    """``n`` chat request fields of KV-retrieval prompts (4 pairs, about 400 tokens): one per
    sample of the bundled KV sample (gold pair first), the user turn and the assistant turn it
    continues (``continue_final_message``)."""
    out = []
    for p in kv_prompts(4 * n, 4)[::4]:  # kv_prompts gives each sample at its 4 positions
        messages = [{"role": "user", "content": p.user}]
        if not p.assistant_prefix:
            out.append({"messages": messages})
            continue
        messages.append({"role": "assistant", "content": p.assistant_prefix})
        out.append(
            {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
        )
    return out


def bad_requests(model: str, window: int) -> list[tuple[str, bytes, int]]:
    """The burst's bad requests for a server of ``model`` whose window is ``window`` tokens:
    ``(kind, JSON body, the status it must get)``."""

    def chat(content, name: str = model, **extra) -> bytes:
        body = {"model": name, "messages": [{"role": "user", "content": content}], **extra}
        return json.dumps(body).encode()

    return [
        ("bad JSON", b'{"model": "' + model.encode() + b'", "messages": [', 400),
        ("not an object", b"[1, 2, 3]", 400),
        ("content a number", chat(5), 400),
        ("max_tokens a string", chat("hi", max_tokens="lots"), 400),
        ('stream "yes"', chat("hi", stream="yes"), 400),
        ("5 MB body", chat("lorem ipsum " * (5 * 1024 * 1024 // 12)), 413),
        ("prompt over the window (tokenized)", chat("word " * (window + 16), max_tokens=8), 400),
        ("prompt over the window (by length)", chat("w" * (129 * window), max_tokens=8), 400),
        ("unknown model", chat("hi", name=model + "-nowhere"), 404),
    ]


def openai_error(r) -> bool:
    """Whether response ``r`` is a 4xx whose body is OpenAI's ``{"error": {message, type, param,
    code}}`` with a one-line message."""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        400 <= r.status_code < 500
        and isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and bool(error["message"])
        and "\n" not in error["message"]
    )


def nearest_rank(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` by nearest rank (``None`` when empty)."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(math.ceil(q * len(xs)) - 1, 0)]


@dataclass
class Level:
    """One level's outcome: prompt index -> answer text and latency (answered requests), the
    failed requests' errors, the wall time, and the prompt tokens the server counted."""

    clients: int
    sent: int = 0
    answers: dict[int, str] = field(default_factory=dict)
    latency: dict[int, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0


async def _ask(client, body: dict) -> tuple[str, int]:
    """The answer text and prompt tokens of one chat request.

    Raises:
        RuntimeError: not a 200 (its status and the start of its body).
    """
    r = await client.post("/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:120]}")
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens"]


async def _level(client, bodies: list[dict], clients: int, max_seconds: float) -> Level:
    """Send ``bodies`` in order from ``clients`` closed-loop clients; none starts a request
    after ``max_seconds``."""
    level = Level(clients)
    pending = iter(range(len(bodies)))
    start = time.perf_counter()

    async def one_client():
        while time.perf_counter() - start < max_seconds and (i := next(pending, None)) is not None:
            level.sent += 1
            t0 = time.perf_counter()
            try:
                level.answers[i], level.prompt_tokens[i] = await _ask(client, bodies[i])
                level.latency[i] = time.perf_counter() - t0
            except Exception as e:  # a lost request is counted, not raised
                level.errors.append(f"{type(e).__name__}: {e}"[:200])

    await asyncio.gather(*(one_client() for _ in range(clients)))
    level.seconds = time.perf_counter() - start
    return level


async def _burst(client, bad: list[tuple[str, bytes, int]], rounds: int) -> list[dict]:
    """Send every bad request at once, ``rounds`` times one round after the other: per kind,
    its expected status, the statuses got, and how many were refused as expected in OpenAI's
    error format."""
    got: dict[str, list] = {kind: [] for kind, _, _ in bad}

    async def send(kind: str, content: bytes, status: int):
        try:
            r = await client.post(
                "/chat/completions", content=content, headers={"content-type": "application/json"}
            )
        except Exception as e:
            got[kind].append((type(e).__name__, False))
            return
        got[kind].append((r.status_code, r.status_code == status and openai_error(r)))

    for _ in range(rounds):
        await asyncio.gather(*(send(*b) for b in bad))
    return [
        {
            "kind": kind,
            "expected": status,
            "statuses": sorted({str(s) for s, _ in got[kind]}),
            "sent": len(got[kind]),
            "refused": sum(ok for _, ok in got[kind]),
        }
        for kind, _, status in bad
    ]


def _row(level: Level, base: float | None, ref: dict[int, str], n_prompts: int) -> dict:
    """A level's figures: counts, requests/s, its ratio to ``base`` (1 client's requests/s;
    ``None`` for the 1-client level itself, whose ratio is 1), p50/p95 latency, and how many
    answers equal the sequential ones (``ref``, by prompt index modulo ``n_prompts``)."""
    compared = [i for i in level.answers if i % n_prompts in ref]
    rps = len(level.answers) / level.seconds if level.seconds else 0.0
    lat = list(level.latency.values())
    return {
        "clients": level.clients,
        "sent": level.sent,
        "answered": len(level.answers),
        "failed": len(level.errors),
        "errors": level.errors[:5],
        "seconds": round(level.seconds, 2),
        "requests_per_s": round(rps, 4),
        "ratio_to_1_client": 1.0 if base is None else round(rps / base, 3) if base else None,
        "p50_s": None if not lat else round(nearest_rank(lat, 0.5), 3),
        "p95_s": None if not lat else round(nearest_rank(lat, 0.95), 3),
        "compared": len(compared),
        "same_as_sequential": sum(level.answers[i] == ref[i % n_prompts] for i in compared),
    }


async def _still_answers(client, url: str, body: dict, expected: str | None) -> bool:
    """Whether ``/health`` answers 200 and ``body`` gets the answer ``expected`` (``False``,
    not an exception, for a server that does not)."""
    try:
        health = await client.get(url.removesuffix("/v1") + "/health")
        return health.status_code == 200 and (await _ask(client, body))[0] == expected
    except Exception:
        return False


async def _table_run(
    client, bodies: list[dict], levels: list[int], max_seconds: float, progress, what: str
) -> tuple[list[dict], dict[int, str], list[int]]:
    """One warm-up request, then every level in turn (1 client first): the rows, the sequential
    answers (prompt index -> text) and the prompt tokens of each sequential answer."""
    await _ask(client, bodies[0])
    rows, ref, tokens, base = [], {}, [], None
    for c in levels:
        progress(f"{what}: {c} client(s)")
        level = await _level(client, bodies, c, max_seconds)
        if c == 1:
            ref, tokens = dict(level.answers), list(level.prompt_tokens.values())
        rows.append(_row(level, None if c == 1 else base, ref, len(bodies)))
        base = rows[0]["requests_per_s"]
    return rows, ref, tokens


async def _run(
    url: str,
    model: str,
    levels: list[int],
    short: list[dict],
    long: list[dict],
    burst_clients: int,
    burst_rounds: int,
    max_seconds: float,
    progress: Callable[[str], object],
) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=max_seconds, limits=limits) as client:
        info = (await client.get("/models")).json()["data"][0]
        short = [{"model": model, "max_tokens": MAX_TOKENS, **b} for b in short]
        long = [{"model": model, "max_tokens": MAX_TOKENS, **b} for b in long]
        rows, ref, short_tokens = await _table_run(
            client, short, levels, max_seconds, progress, "short prompts"
        )
        progress(f"short prompts: {burst_clients} client(s) and a burst of bad requests")
        bad = bad_requests(model, info["max_model_len"])
        good = asyncio.ensure_future(_level(client, short, burst_clients, max_seconds))
        burst = await _burst(client, bad, burst_rounds)
        burst_row = _row(await good, rows[0]["requests_per_s"], ref, len(short))
        burst_row["burst"] = burst
        burst_row["answers_after"] = await _still_answers(client, url, short[0], ref.get(0))
        long_rows, long_ref, long_tokens = await _table_run(
            client, long, levels, max_seconds, progress, "long prompts"
        )
    return {
        "short": rows,
        "burst": burst_row,
        "long": long_rows,
        "short_prompt_tokens": short_tokens,
        "long_prompt_tokens": long_tokens,
        "short_answers": [ref.get(i) for i in range(len(short))],
        "long_answers": [long_ref.get(i) for i in range(len(long))],
        "window": info["max_model_len"],
        "served_dtype": info["ragfix"]["dtype"],
    }


def _cells(r: dict) -> list[str]:
    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    return [
        f"{r['answered']}/{r['sent']}",
        num(r["requests_per_s"], ".3f"),
        num(r["ratio_to_1_client"], ".2f"),
        num(r["p50_s"], ".2f"),
        num(r["p95_s"], ".2f"),
        f"{r['same_as_sequential']}/{r['compared']}",
    ]


#: the columns of both tables (the short-prompt table adds the bad requests refused)
HEADERS = [
    "clients", "answered", "requests/s", "ratio to 1 client", "p50 s", "p95 s", "same answers",
]  # fmt: skip


def load_tables(details: dict, dtype: str) -> list[TableSpec]:
    """The two tables of the server in ``dtype`` (its figures:
    ``details["measurements"][dtype]``): short prompts (a row per client count, then the burst
    row, with the bad requests refused), and long prompts."""
    m = details["measurements"][dtype]
    burst = m["burst"]
    bad_sent = sum(k["sent"] for k in burst["burst"])
    bad_refused = sum(k["refused"] for k in burst["burst"])
    rows = [[str(r["clients"]), *_cells(r), "-"] for r in m["short"]]
    rows.append([f"{burst['clients']} + burst", *_cells(burst), f"{bad_refused}/{bad_sent}"])
    target_clients, target = TARGET
    at = [r for r in m["short"] if r["clients"] == target_clients]
    lines = [
        "answered: good requests answered 200 of those sent; same answers: answers identical to "
        "the 1-client (sequential) answer of the same prompt, of those compared; bad refused: "
        "bad requests answered with their own 4xx in OpenAI's error format.",
        "burst: "
        + "; ".join(
            f"{k['kind']} {k['refused']}/{k['sent']} ({'/'.join(k['statuses'])})"
            for k in burst["burst"]
        )
        + f". After it the server answered (/health, and the first prompt's sequential answer): "
        f"{'yes' if burst['answers_after'] else 'NO'}.",
    ]
    if at and at[0]["ratio_to_1_client"] is not None:
        ratio = at[0]["ratio_to_1_client"]
        met = "met" if ratio >= target else "not met"
        lines.append(
            f"{target_clients} clients: {ratio:.2f}x the requests/s of 1 client (issue 31's "
            f"target: {target:.0f}x, {met})."
        )
    lines.append(f"{details['machine']}; {details['server']} --dtype {dtype} (1 math thread).")

    def tokens(key: str) -> str:
        t = m[key]
        return f"{min(t)}-{max(t)}" if t else "?"

    short = TableSpec(
        f"{details['model']} · {dtype} · ragfix serve on 127.0.0.1 · short chat prompts "
        f"({tokens('short_prompt_tokens')} prompt tokens, max_tokens {details['max_tokens']})",
        [*HEADERS, "bad refused"],
        rows,
        lines,
    )
    long = TableSpec(
        f"{details['model']} · {dtype} · ragfix serve on 127.0.0.1 · long KV prompts "
        f"({tokens('long_prompt_tokens')} prompt tokens, max_tokens {details['max_tokens']}), "
        f"prefill-bound, no target",
        HEADERS,
        [[str(r["clients"]), *_cells(r)] for r in m["long"]],
    )
    return [short, long]


def dtype_table(details: dict) -> TableSpec:
    """The servers of several dtypes side by side: for each prompt kind and client count, the
    first dtype's requests/s, and each later dtype's with its ratio to the first's; under it,
    how many sequential (1-client) answers of each later dtype are identical to the first's,
    and issue 57's target (:data:`DTYPE_TARGET`, bf16 against float32).

    Raises:
        ConfigError: the dtypes' levels are not the same client counts.
    """
    names, m = details["dtypes"], details["measurements"]
    first = names[0]
    headers = ["prompts", "clients", f"{first} requests/s"]
    for n in names[1:]:
        headers += [f"{n} requests/s", f"{n} / {first}"]

    def rps(name: str, kind: str) -> dict[int, float]:
        """Requests/s by client count (every dtype ran the same counts)."""
        out = {r["clients"]: r["requests_per_s"] for r in m[name][kind]}
        if len(out) != len(m[name][kind]) or set(out) != {r["clients"] for r in m[first][kind]}:
            raise ConfigError(f"{name}'s {kind}-prompt levels are not {first}'s")
        return out

    rows, lines = [], []
    for kind in ("short", "long"):
        by = {n: rps(n, kind) for n in names}
        for c, base in by[first].items():
            row = [kind, str(c), f"{base:.3f}"]
            for n in names[1:]:
                row += [f"{by[n][c]:.3f}", f"{by[n][c] / base:.2f}" if base else "-"]
            rows.append(row)
    clients, target = DTYPE_TARGET
    for n in names[1:]:
        for kind in ("short", "long"):
            pairs = [
                (a, b)
                for a, b in zip(m[first][f"{kind}_answers"], m[n][f"{kind}_answers"], strict=True)
                if a is not None and b is not None
            ]
            same = sum(a == b for a, b in pairs)
            lines.append(
                f"{n}, {kind} prompts: {same}/{len(pairs)} sequential answers identical to "
                f"{first}'s."
            )
        if (first, n) == ("float32", "bfloat16"):
            base, other = rps(first, "short").get(clients), rps(n, "short").get(clients)
            if not base:
                verdict = f"not measured: no float32 requests/s at {clients} clients"
            else:
                ratio = other / base
                met = "met" if ratio >= target else "not met"
                verdict = f"bfloat16 {ratio:.2f}x float32's requests/s, {met}"
            lines.append(
                f"{clients} clients, short prompts: {verdict} (issue 57's target: {target:.0f}x)."
            )
    lines.append(
        f"Each dtype's server ran alone, one after the other; {details['machine']}; "
        f"{details['server']} (1 math thread)."
    )
    return TableSpec(
        f"{details['model']} · ragfix serve on 127.0.0.1 · requests/s in each dtype against "
        f"{first}",
        headers,
        rows,
        lines,
    )


def bench_serve(
    model: str = "smollm2",
    clients: list[int] | None = None,
    requests: int = 32,
    long_requests: int = 16,
    burst_clients: int = 8,
    burst_rounds: int = 4,
    max_seconds: float = 300.0,
    max_batch_size: int | None = None,
    max_wait_ms: float | None = None,
    dtypes: Sequence[str] = ("auto",),
    progress: Callable[[str], object] = lambda _: None,
) -> tuple[list[TableSpec], dict]:
    """The load test (see the module docstring) against ``ragfix serve --model MODEL`` on the
    CPU, at each client count of ``clients`` (default 1, 4, 8, 16; 1, the sequential reference,
    is always run, first), once per dtype of ``dtypes``: a server in each, one after the other.

    Args:
        max_batch_size, max_wait_ms: passed to ``ragfix serve`` (its defaults when ``None``).
        dtypes: the model's dtypes (:func:`~ragfix.models.device.dtype_axis`, on the CPU).

    Raises:
        ConfigError: a client count below 1, ``long_requests`` outside 1-60, an unknown dtype
            or one named twice.
        RuntimeError: ``ragfix serve`` did not start (:func:`ragfix.serve.serving`).

    Returns:
        ``(tables, details)``: with several dtypes, first their comparison
        (:func:`dtype_table`); then each dtype's short-prompt and long-prompt tables
        (:func:`load_tables`). ``details`` holds the settings, the machine and, per dtype,
        ``measurements`` (one row per level, the burst's counts per kind, the sequential
        answers).
    """
    import torch

    from ragfix.models.device import dtype_axis

    levels = sorted({1, *(clients or (4, 8, 16))})
    if levels[0] < 1 or burst_clients < 1 or not 1 <= long_requests <= 60:
        raise ConfigError(
            "clients and burst clients must be at least 1, long requests 1 to 60 (one per "
            "sample of the bundled KV sample)"
        )
    names = dtype_axis(dtypes, torch.device("cpu"))
    args = ["--model", model, "--device", "cpu"]
    if max_batch_size is not None:
        args += ["--max-batch-size", str(max_batch_size)]
    if max_wait_ms is not None:
        args += ["--max-wait-ms", str(max_wait_ms)]
    measurements = {}
    for name in names:
        say = progress if len(names) == 1 else (lambda msg, n=name: progress(f"{n}: {msg}"))
        say("starting ragfix serve")
        with serving(*args, "--dtype", name) as url:
            measurements[name] = asyncio.run(
                _run(
                    url,
                    model,
                    levels,
                    short_prompts(requests),
                    long_prompts(long_requests),
                    burst_clients,
                    burst_rounds,
                    max_seconds,
                    say,
                )
            )
    details = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "requests": requests,
        "long_requests": long_requests,
        "burst_rounds": burst_rounds,
        "max_seconds": max_seconds,
        "dtypes": names,
        "server": "ragfix serve " + " ".join(args[2:]),
        "machine": f"{platform.machine()}, cpu, clients and server on one machine",
        "measurements": measurements,
    }
    tables = [t for name in names for t in load_tables(details, name)]
    return ([dtype_table(details)] if len(names) > 1 else []) + tables, details
