"""``ragfix serve`` under real traffic: clients that go away, standard clients, an API key,
limits, malformed input, batching (the cases of issue 31, from public bug reports of similar
servers: vLLM, llama.cpp, Ollama, letta, garak, FastAPI).

A real uvicorn server on 127.0.0.1 serves the real SmolLM2 (the session's ``smol`` backend, in
this process, so a test can count the model's forward passes: one per decoding step); the
batching test's serves the shared tiny Qwen3 (``tiny_qwen3_dir``); the API key test starts
``ragfix serve`` itself as a subprocess over a tiny seeded model folder.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import re
import socket
import threading
import time

import httpx
import pytest
from conftest import BUNDLED, tiny_folder

from ragfix.prompts import TaskPrompt
from ragfix.serve import create_app, exposure_warning, free_port, serving
from ragfix.serve_guard import server_config

MODEL = "smollm2"
TINY = "tiny"
Q = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake."}]


class Steps:
    """Counts the model's forward passes (one per decoding step, one per prefill)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(self._count)

    def _count(self, *args):
        self.n += 1


@contextlib.contextmanager
def running(app, limits=None):
    """Serve ``app`` with uvicorn as ``ragfix serve`` configures it (:func:`server_config`:
    the ``Host`` check, deadlines and a connection limit, of ``limits``) on a free port of
    127.0.0.1 (a thread); yields its URL."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(server_config(app, "127.0.0.1", port, limits, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(smol):
    """``(url, server, steps)``: SmolLM2 served on 127.0.0.1, its :class:`~ragfix.serve.Server`
    and a forward-pass counter."""
    app = create_app(smol, MODEL)
    steps = Steps(smol.model)
    with running(app) as url:
        yield url, app.state.server, steps
    steps.handle.remove()


@pytest.fixture(scope="module")
def served_tiny(tiny_qwen3_dir):
    """``(url, server)``: the shared tiny Qwen3 served on 127.0.0.1 as :data:`TINY` and its
    :class:`~ragfix.serve.Server`, for the tests whose answers batched must equal the answers
    alone (its peaked attention changes an answer read with another row's padding or
    positions) and need no model that reads."""
    from ragfix.backends import load_backend

    app = create_app(load_backend("vanilla", model=tiny_qwen3_dir, device="cpu"), TINY)
    with running(app) as url:
        yield url, app.state.server


def post(url: str, path: str, body, timeout: float = 120, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, timeout=timeout, **kw)
    return httpx.post(url + path, json=body, timeout=timeout, **kw)


def chat(url: str, messages=Q, **kw) -> httpx.Response:
    return post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, **kw})


def idle(server, timeout: float = 60.0) -> float:
    """Wait until the model thread holds no lock and has nothing queued; the seconds waited."""
    start = time.monotonic()
    while server.lock.locked() or server.worker._queue:
        assert time.monotonic() - start < timeout, "the model stayed busy"
        time.sleep(0.01)
    return time.monotonic() - start


def sse(lines) -> list:
    """The JSON chunks of SSE ``lines`` (``[DONE]`` as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed(url: str, path: str, body: dict) -> tuple[str, list]:
    """The text of a streamed answer and its chunks."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = sse(r.iter_lines())
    assert chunks[-1] == "[DONE]"
    text = ""
    for c in chunks[:-1]:
        for ch in c["choices"]:
            text += ch["delta"].get("content") or "" if "delta" in ch else ch["text"]
    return text, chunks


# ------------------------------------------------------------------ cancellation (C15, C16)


def test_a_closed_stream_stops_its_generation_and_frees_the_model(served):
    """C15 (vLLM PR#24586): a 300-token stream closed after 3 chunks stops within a step; the
    next request is answered at once, as it is alone."""
    url, server, steps = served
    ref = chat(url, max_tokens=8).json()["choices"][0]["message"]["content"]
    start = time.monotonic()
    assert chat(url, max_tokens=8).status_code == 200
    alone = time.monotonic() - start
    body = {"model": MODEL, "messages": LONG, "max_tokens": 300, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n == 3:
                break
        at_close = steps.n
    idle(server)
    assert steps.n - at_close <= 2  # the step running when the client left, and at most one more
    assert steps.n < at_close + 300
    start = time.monotonic()
    again = chat(url, max_tokens=8).json()["choices"][0]["message"]["content"]
    assert again == ref and time.monotonic() - start < 5 * alone + 1


def test_a_dropped_socket_stops_its_generation(served):
    """C15, raw: a client sends a streaming request and closes its socket without reading."""
    url, server, steps = served
    body = json.dumps({"model": MODEL, "messages": LONG, "max_tokens": 300, "stream": True})
    port = int(url.rsplit(":", 1)[1])
    sk = socket.create_connection(("127.0.0.1", port))
    sk.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
        + b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body.encode()
    )
    start = steps.n
    while steps.n < start + 3:  # it is generating
        time.sleep(0.01)
    sk.close()
    at_close = steps.n
    idle(server)
    assert steps.n - at_close <= 2
    assert chat(url, max_tokens=4).status_code == 200


def test_an_abandoned_request_is_cancelled(served, caplog):
    """C16: a non-streamed request whose client gives up after 1 s stops within a step, and the
    openai client's abandoned retries (``timeout=1, max_retries=2``) leave no work behind, and
    no unretrieved exception of the abandoned requests in the server's log."""
    import gc

    from openai import APITimeoutError, OpenAI

    url, server, steps = served
    body = {"model": MODEL, "messages": LONG, "max_tokens": 300}
    with pytest.raises(httpx.TimeoutException):
        post(url, "/v1/chat/completions", body, timeout=1.0)
    at_close = steps.n
    idle(server)
    assert steps.n - at_close <= 2

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=1.0, max_retries=2)
    with pytest.raises(APITimeoutError):
        client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=300)
    at_close = steps.n
    idle(server)
    assert steps.n - at_close <= 2
    start = time.monotonic()
    assert chat(url, max_tokens=4).status_code == 200
    assert time.monotonic() - start < 10
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def _method(base, name: str):
    """A method backend over the vanilla backend ``base``'s model and a prompt it reads along its
    own path (GALI beyond its window, set-based through its passage layout)."""
    from ragfix.backends.gali import GaliBackend
    from ragfix.backends.set_based import SetBasedBackend
    from ragfix.connectors.litm import load_samples
    from ragfix.tasks import task_prompt

    story = TaskPrompt(user="Write a long story about a lighthouse. " * 8)
    if name == "vanilla":
        return base, story
    if name == "gali":
        return GaliBackend(base.model, base.tokenizer, train_window=96), story
    [sample] = load_samples(BUNDLED / "kv_16pairs_sample.jsonl.gz", 4, 1)
    return SetBasedBackend(base.model, base.tokenizer), task_prompt(
        sample, sample.passages_with_gold_at(1)
    )


@pytest.mark.parametrize("name", ["vanilla", "gali", "set-based"])
def test_cancel_stops_generate_and_stream_between_steps(tiny_dir, name):
    """The model interface, on each decoding path (``transformers``' generate with and without
    prefix reuse, GALI's own loop, a layout method's loop): ``cancel`` stops ``generate`` and
    ``stream`` within a step and raises ``Cancelled``. Steps are counted at the LM head (of the
    shared tiny model: what is counted is steps, not what the model reads)."""
    from ragfix.backends import load_backend
    from ragfix.errors import Cancelled

    base = load_backend("vanilla", model=tiny_dir, device="cpu")
    backend, prompt = _method(base, name)
    steps = Steps(base.model.lm_head)
    try:

        class AfterFive:
            def is_set(self):
                return steps.n >= 5

        for reuse in (False, True):
            steps.n = 0
            with pytest.raises(Cancelled):
                backend.generate([prompt, prompt], max_new_tokens=100, stop_at_newline=False,
                                 prefix_reuse=reuse, cancel=AfterFive())  # fmt: skip
            assert steps.n <= 7
        stop = threading.Event()
        pieces = backend.stream(prompt, 100, cancel=stop)
        with pytest.raises(Cancelled):
            for i, _ in enumerate(pieces):
                if i == 2:
                    stop.set()
                    at = steps.n
        assert steps.n - at <= 2
    finally:
        steps.handle.remove()


# ------------------------------------------------------------------ access and limits (S2, S3)


def test_api_key_from_the_environment_guards_every_route_but_health(tmp_path, monkeypatch):
    """S2 (llama.cpp PR#9776): ``RAGFIX_API_KEY`` (never ``OPENAI_API_KEY``) is required on
    every route but ``/health``; docs and schema are off; the openai client with the key works."""
    from openai import AuthenticationError, OpenAI

    folder = tiny_folder(tmp_path / "tiny")
    monkeypatch.setenv("RAGFIX_API_KEY", "s3cret")
    monkeypatch.setenv("OPENAI_API_KEY", "not-the-servers")
    with serving("--model", str(folder), "--device", "cpu") as url:
        base = url.removesuffix("/v1")
        assert httpx.get(base + "/health").status_code == 200
        body = {"model": str(folder), "messages": Q, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(url + "/chat/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/docs", "/openapi.json", "/redoc", "/v1/models"):
            r = httpx.get(base + path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
        for path in ("/docs", "/openapi.json"):
            r = httpx.get(base + path, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 404 and "error" in r.json()
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url, max_retries=0).models.list()  # reads OPENAI_API_KEY
        ok = OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        answer = ok.chat.completions.create(model=str(folder), messages=Q, max_tokens=2)
        assert answer.usage.completion_tokens <= 2


def test_docs_are_open_without_a_key_and_exposure_is_warned(served):
    url, _, _ = served
    assert httpx.get(url + "/docs").status_code == 200
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("localhost", None) is None
    assert exposure_warning("::1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    warning = exposure_warning("0.0.0.0", None)
    assert "without an API key" in warning and "RAGFIX_API_KEY" in warning


def test_a_web_page_cannot_drive_the_local_server(served):
    """Issue 43: what a page of another site can send to 127.0.0.1 without a CORS preflight (a
    form, a no-cors ``fetch``: ``text/plain``, form types, no type; FastAPI GHSA-8h2j-cgx8-6xv7)
    is refused 415 before the model runs, and a request carrying the page's own name in ``Host``
    (DNS rebinding, Ollama CVE-2024-28224) 403 on every route; the server's own names, with its
    port, are answered."""
    url, server, steps = served
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "messages": Q, "max_tokens": 2}).encode()
    before = steps.n
    for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", None):  # fmt: skip
        headers = {"content-type": kind} if kind else {}
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = post(url, path, body, headers=headers)
            assert r.status_code == 415, (kind, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "unsupported_media_type" and "\n" not in error["message"]
    form = httpx.post(url + "/v1/completions", data={"model": MODEL, "prompt": "hi"})
    assert form.status_code == 415
    assert steps.n == before  # the model never ran
    r = post(url, "/v1/chat/completions", body, headers={"content-type": "Application/JSON"})
    assert r.status_code == 200
    for host in ("evil.example", f"evil.example:{port}", f"attacker.test:{port}", "127.0.0.1",
                 f"localhost:{port + 1}", f"127.0.0.2:{port}"):  # fmt: skip
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/health"), ("GET", "/docs")):  # fmt: skip
            r = httpx.request(method, url + path, json={"model": MODEL, "messages": Q,
                              "max_tokens": 2}, headers={"host": host})  # fmt: skip
            assert r.status_code == 403, (host, path, r.status_code)
            assert r.json()["error"]["code"] == "host_not_allowed"
            assert repr(host) in r.json()["error"]["message"]
    assert steps.n == before + 2  # the one accepted request (prefill, one step)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
        assert httpx.get(url + "/v1/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_are_a_validated_setting(smol):
    """``allowed_hosts`` (``ragfix serve --allowed-hosts``) adds names, with any port or the one
    named, or any host with ``*``; a name that is not a host is refused when the setting is
    built."""
    from pydantic import ValidationError

    from ragfix.serve_guard import ServeLimits

    limits = ServeLimits(allowed_hosts=" rag.lan, Other.lan:8080")
    assert limits.allowed_hosts == ("rag.lan", "other.lan:8080")
    assert ServeLimits(allowed_hosts="").allowed_hosts == ()
    for bad in ("http://rag.lan", "rag.lan/v1", "rag.lan,", "a b", "rag.lan:port"):
        with pytest.raises(ValidationError, match="allowed_hosts"):
            ServeLimits(allowed_hosts=bad)
    app = create_app(smol, MODEL)
    with running(app, limits) as url:
        port = int(url.rsplit(":", 1)[1])
        for host, status in ((f"rag.lan:{port}", 200), ("RAG.lan:1", 200), ("other.lan:8080", 200),
                             (f"other.lan:{port}", 403), (f"evil.example:{port}", 403),
                             (f"localhost:{port}", 200)):  # fmt: skip
            r = httpx.post(url + "/v1/completions", headers={"host": host},
                           json={"model": MODEL, "prompt": "The capital of France is",
                                 "max_tokens": 1})  # fmt: skip
            assert r.status_code == status, (host, r.text)
    with running(create_app(smol, MODEL), ServeLimits(allowed_hosts="*")) as url:
        assert httpx.get(url + "/health", headers={"host": "any.example"}).status_code == 200


def test_big_bodies_and_prompts_are_refused_without_the_model(served, smol):
    """S3 (FastAPI#1181): a 5 MB message is 413 before it is parsed; a prompt too long for the
    window is 400 before it is tokenized; one that must be tokenized to be found too long is
    tokenized beside a running generation, not after it."""
    url, server, _ = served
    big = "lorem ipsum dolor sit amet " * (5 * 1024 * 1024 // 27)
    r = chat(url, [{"role": "user", "content": big}], max_tokens=8)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    # a long generation holds the model while the refusals come back
    body = {"model": MODEL, "messages": LONG, "max_tokens": 300, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        while '"content": ""' in next(lines) or not server.lock.locked():
            pass  # until the first piece of the answer
        huge = "word " * 220_000  # 1.1 M characters: more than 8192 tokens can hold
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 4})
        assert r.status_code == 400 and "refused before tokenizing" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "context_length_exceeded"
        long = "word " * 9000  # to be tokenized to be found too long
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": long, "max_tokens": 4})
        counted = f"the prompt has {len(smol.tokenize(long))} tokens"
        assert r.status_code == 400 and counted in r.json()["error"]["message"]
        assert server.lock.locked()  # answered while the generation still runs
    idle(server)
    assert chat(url, max_tokens=4).status_code == 200


MALFORMED = [
    b"", b"{", b"}", b"null", b"[]", b"123", b'"str"', b"{'model': 'x'}", b"\xff\xfe\x00",
    b'{"model": "smollm2", "messages": [}', b'{"model": "smollm2"', b"{" * 1000, b"[" * 100000,
    b'{"model": "smollm2", "messages": "x"}', b'{"model": 1, "messages": []}',
    b'{"messages": [{"role": "user"}]}',
    b'{"model": "smollm2", "messages": [{"role": "user", "content": 5}]}',
    b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "lots"}',
    b"NaN", b"Infinity", b'{"model": "smollm2", "max_tokens": NaN}', b"\x00\x01\x02", b"\r\n\r\n",
    b"<xml/>", b'{"a":' + b"1" * 5000 + b"}",
    b'{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"stream":"yes"}',
    b'{"model":"smollm2","messages":[{"role":"user","content":"\\ud800"}]}',
    b'{"model":"smollm2","messages":[{"role":"user","content":"\\ud800 and more"}]}',
    b'{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"n":"two"}',
    b'{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"stop":[1,2]}',
    b'{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":5.5}',
    b'{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":true}',
    b'{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
    b'{"model":"smollm2","messages":[{"role":"user","content":[{"type":"text"}]}]}',
    b'{"model":"smollm2","messages":[{"role":"user","content":["hello"]}]}',
]  # fmt: skip
BAD_COMPLETIONS = [
    {"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"prompt": ["a", "b"]}, {"prompt": [1, 2]},
    {"prompt": [[1], [2]]}, {"prompt": [-1]}, {"prompt": [10**9]}, {"prompt": [1.5]},
    {"prompt": "\ud800"}, {"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "echo": True, "logprobs": 21}, {"prompt": "hi", "echo": True, "stream": True},
]  # fmt: skip


def test_malformed_requests_are_400s_in_openai_format(served):
    """C9b (letta#3381), S5: nothing a client sends is a 500; every refusal is
    ``{"error": {message, type, param, code}}`` with a one-line message."""
    url, _, _ = served
    ref = chat(url, max_tokens=4).json()["choices"][0]["message"]["content"]
    for body in MALFORMED:
        r = post(url, "/v1/chat/completions", body, headers={"content-type": "application/json"})
        assert r.status_code in (400, 404), (body[:60], r.status_code, r.text[:200])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, body[:60]
        assert error["message"] and "\n" not in error["message"]
    for extra in BAD_COMPLETIONS:
        raw = json.dumps({"model": MODEL, **extra}).encode()  # a lone surrogate as \ud800
        r = post(url, "/v1/completions", raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (extra, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"
    stream_yes = chat(url, max_tokens=4, stream="yes")
    assert stream_yes.status_code == 400 and stream_yes.json()["error"]["param"] == "stream"
    for method, path in (("GET", "/nowhere"), ("GET", "/v1/chat/completions")):
        r = httpx.request(method, url + path)
        assert r.status_code in (404, 405) and set(r.json()["error"]) >= {"message", "code"}
    assert chat(url, max_tokens=4).json()["choices"][0]["message"]["content"] == ref


# ------------------------------------------------------------------ what clients send


NEUTRAL_FIELDS = {
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {},
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
    "parallel_tool_calls": False, "metadata": {}, "store": False, "service_tier": "auto",
    "user": "u1", "seed": 1, "n": 1, "temperature": 0,
}  # fmt: skip
#: fields of other OpenAI-compatible servers (vLLM), sent by clients as extra body fields
EXTRA_NEUTRAL_FIELDS = {"top_k": 1, "repetition_penalty": 1.0, "min_p": 0.0}
REFUSED_FIELDS = {
    "frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"17": 5},
    "response_format": {"type": "json_object"}, "tool_choice": "required", "n": 2,
    "tools": [{"type": "function", "function": {"name": "f"}}],
}  # fmt: skip


def test_neutral_openai_fields_are_accepted_and_others_refused(served):
    """C12 (garak#748): the openai client with OpenAI's neutral settings gets the plain answer;
    a value that would change decoding is refused in one line naming the field."""
    from openai import BadRequestError, OpenAI

    url, _, _ = served
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    plain = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=6)
    with_all = client.chat.completions.create(
        model=MODEL, messages=Q, max_tokens=6, **NEUTRAL_FIELDS, extra_body=EXTRA_NEUTRAL_FIELDS
    )
    assert with_all.choices[0].message.content == plain.choices[0].message.content
    for name, value in REFUSED_FIELDS.items():
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=Q, max_tokens=2, **{name: value})
        assert e.value.body["param"] == name and "is not supported" in e.value.body["message"]
    with pytest.raises(BadRequestError, match="repetition_penalty 1.2 is not supported"):
        client.chat.completions.create(
            model=MODEL, messages=Q, max_tokens=2, extra_body={"repetition_penalty": 1.2}
        )


def test_stream_usage_chunk_and_unknown_stream_options(served):
    """C3 (openai-openapi PR#240): ``include_usage`` ends the stream with a ``choices: []``
    chunk carrying the usage of the non-streamed answer; unknown stream options are refused."""
    url, _, _ = served
    body = {"model": MODEL, "messages": Q, "max_tokens": 12}
    whole = chat(url, max_tokens=12).json()
    text, chunks = streamed(
        url, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    *pieces, last, done = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in pieces)
    assert text == whole["choices"][0]["message"]["content"]
    assert pieces[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    _, plain = streamed(url, "/v1/chat/completions", body)
    assert all("usage" not in c for c in plain[:-1])
    r = chat(url, max_tokens=4, stream=True, stream_options={"bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.bogus"


def test_completions_return_the_raw_continuation_streamed_or_not(served, smol):
    """C4b (ik_llama.cpp#467): ``/v1/completions`` gives the continuation with its leading
    space, the same streamed and not; chat likewise; the backend's own answers (what the sweep
    scores) stay stripped."""
    url, _, _ = served
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    whole = post(url, "/v1/completions", body).json()["choices"][0]["text"]
    text, _ = streamed(url, "/v1/completions", body)
    assert whole == text and whole.startswith(" Paris")
    for stop in ("\n", ["\n"]):
        b = {"model": MODEL, "prompt": "Fruits:\n1. Apple\n2.", "max_tokens": 20, "stop": stop}
        cut = post(url, "/v1/completions", b).json()["choices"][0]["text"]
        assert cut == streamed(url, "/v1/completions", b)[0] and "\n" not in cut.strip()
    msgs = [{"role": "user", "content": "List three fruits, one per line."}]
    c = chat(url, msgs, max_tokens=30).json()["choices"][0]["message"]["content"]
    assert c == streamed(url, "/v1/chat/completions",
                         {"model": MODEL, "messages": msgs, "max_tokens": 30})[0]  # fmt: skip
    [gen] = smol.generate(["The capital of France is"], max_new_tokens=8, stop_at_newline=False)
    assert gen.text == whole.strip()


def test_echo_scores_the_prompt_as_loglikelihood(served, smol):
    """``echo`` with ``logprobs: 0`` (and ``max_tokens: 0``): each prompt token's
    log-probability; the continuation's sum equals ``Backend.loglikelihood``."""
    url, _, _ = served
    ctx, cont = "The capital of France is", " Paris, a city"
    assert smol.tokenize(ctx) + smol.tokenize(cont) == smol.tokenize(ctx + cont)
    body = {"model": MODEL, "prompt": ctx + cont, "echo": True, "logprobs": 0, "max_tokens": 0}
    out = post(url, "/v1/completions", body).json()
    choice = out["choices"][0]
    lp = choice["logprobs"]
    n_ctx = len(smol.tokenize(ctx))
    assert choice["text"] == ctx + cont and "".join(lp["tokens"]) == ctx + cont
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == out["usage"]["prompt_tokens"]
    [ref] = smol.loglikelihood([(ctx, cont)])
    assert sum(lp["token_logprobs"][n_ctx:]) == pytest.approx(ref, abs=1e-4)
    assert out["usage"]["completion_tokens"] == 0
    # with a continuation: the prompt's scores, then the first answer token's
    both = post(url, "/v1/completions", {**body, "max_tokens": 3}).json()["choices"][0]
    assert (
        both["text"].startswith(ctx + cont)
        and len(both["logprobs"]["tokens"]) == len(lp["tokens"]) + 1
    )
    assert both["logprobs"]["token_logprobs"][:-1] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    plain = post(url, "/v1/completions", {"model": MODEL, "prompt": ctx, "echo": True,
                                           "max_tokens": 3}).json()["choices"][0]  # fmt: skip
    assert plain["text"].startswith(ctx) and plain["logprobs"] is None


def test_echo_of_characters_split_into_bytes_keeps_text_offsets_on_the_text(served, smol):
    """Issue 55, item 2: a character the vocabulary splits into bytes is echoed as OpenAI's
    legacy ``bytes:\\xNN`` tokens, and every ``text_offset`` is the character of the echoed
    text where the token begins (a token inside a character: that character's), where
    escaped bytes used to push every later offset past its token."""
    url, _, _ = served
    text = "价格是 ₹ 100, 中国的首都是北京 (Beijing)."
    body = {"model": MODEL, "prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0}
    out = post(url, "/v1/completions", body).json()["choices"][0]
    lp = out["logprobs"]
    ids = smol.encode(text)
    raw = smol.token_bytes(ids)
    assert out["text"] == text and len(lp["tokens"]) == len(ids) and b"".join(raw) == text.encode()
    split = [t for t in lp["tokens"] if t.startswith("bytes:")]
    assert split and all(t == "bytes:" + "".join(f"\\x{c:02x}" for c in b)
                         for t, b in zip(lp["tokens"], raw, strict=True) if t in split)  # fmt: skip
    at_bytes = 0
    for tok, at, b in zip(lp["tokens"], lp["text_offset"], raw, strict=True):
        want = len(text.encode()[:at_bytes].decode("utf-8", errors="ignore"))
        assert at == want, (tok, at, want)
        if not tok.startswith("bytes:"):
            assert text[at : at + len(tok)] == tok
        at_bytes += len(b)
    assert lp["text_offset"][-1] < len(text) and lp["text_offset"] == sorted(lp["text_offset"])


def test_a_model_with_a_bos_token_echoes_it_first_and_scores_as_the_local_model():
    """Issue 55, item 2 (BOS echoes): Gemma 3 270M's tokenizer puts its BOS before a text. The
    server scores the tokens the model reads, BOS first, echoed as vLLM does (``<bos>``, no
    log-probability, at offset 0: it is not in the text), and a remote backend reading the
    echo by token count gets the local model's log-likelihoods, non-Latin text included
    (served scores without the BOS, read by character offsets, differed)."""
    from ragfix.backends import load_backend

    gemma = load_backend("vanilla", model="gemma3-270m")
    text = "The capital of France is Paris"
    pairs = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " Lyon"),
        ("Le prix est de 100 ₹, soit", " un euro"),
        ("中国的首都是北京。", "上海"),
    ]
    with running(create_app(gemma, "gemma3-270m")) as url:
        body = {"model": "gemma3-270m", "prompt": text, "echo": True, "logprobs": 0,
                "max_tokens": 0}  # fmt: skip
        out = post(url, "/v1/completions", body).json()
        lp = out["choices"][0]["logprobs"]
        remote = load_backend("vanilla", model="openai:gemma3-270m", api_base=url + "/v1")
        served = remote.loglikelihood(pairs)
    ids = gemma.encode(text)
    assert ids[0] == gemma.tokenizer.bos_token_id and len(lp["tokens"]) == len(ids)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert lp["tokens"][0] == "<bos>" and lp["token_logprobs"][0] is None
    assert lp["text_offset"][:2] == [0, 0] and "".join(lp["tokens"][1:]) == text
    assert lp["token_logprobs"][1:] == pytest.approx(gemma.token_logprobs(ids).tolist(), abs=1e-4)
    assert served == pytest.approx(gemma.loglikelihood(pairs), abs=1e-3)


def test_a_text_that_fills_the_window_is_scored_through_serve_as_locally(tmp_path):
    """Issue 55, item 2 (the window's limit): a context and continuation of exactly the
    window's tokens (a tiny Llama with a 48-token window) is scored locally; through
    ``ragfix serve`` the scoring request (``max_tokens: 1``) does not fit, and the client asks
    again with ``max_tokens: 0`` (echo only) and gets the local score, where the run stopped."""
    from ragfix.backends import load_backend

    tiny = load_backend("vanilla", model=str(tiny_folder(tmp_path / "tiny", window=48)))
    context = " ".join(["one two three"] * 20)
    ids = tiny.encode(context)
    context = tiny.detokenize(ids[:46])
    pairs = [(context, " four five")]
    assert len(tiny.encode(context)) + len(tiny.tokenize(" four five")) == 48
    with running(create_app(tiny, "tiny")) as url:
        body = {"model": "tiny", "prompt": context + " four five", "echo": True, "logprobs": 1}
        assert error(post(url, "/v1/completions", {**body, "max_tokens": 1}))["code"] == (
            "context_length_exceeded"
        )
        remote = load_backend("vanilla", model="openai:tiny", api_base=url + "/v1")
        served = remote.loglikelihood(pairs)
    assert served == pytest.approx(tiny.loglikelihood(pairs), abs=1e-4)


def test_echo_with_top_logprobs_is_openai_legacy_shape_and_equals_the_backend(served, smol):
    """Issue 43 (lm-evaluation-harness ``local-completions`` sends ``echo: true, logprobs: 1,
    max_tokens: 1`` and was refused): ``echo`` with ``logprobs: N`` gives, in OpenAI's legacy
    shape, each prompt token's log-probability (equal to ``Backend.token_logprobs``; the
    continuation's sum to ``Backend.loglikelihood``, within 1e-4) and its ``N`` most likely
    alternatives (the first token: ``None``), which equal the backend's next-token distribution
    after the context; then the generated token, as lm-eval reads it."""
    url, _, _ = served
    ctx, cont = "The capital of France is", " Paris"
    ids = smol.tokenize(ctx + cont)
    n_ctx = len(smol.tokenize(ctx))
    assert smol.tokenize(ctx) + smol.tokenize(cont) == ids
    body = {"model": MODEL, "prompt": ctx + cont, "echo": True, "logprobs": 5, "max_tokens": 0}
    out = post(url, "/v1/completions", body).json()
    lp = out["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(ids) == out["usage"]["prompt_tokens"]
    assert "".join(lp["tokens"]) == ctx + cont
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(smol.token_logprobs(ids).tolist(), abs=1e-4)
    [ref] = smol.loglikelihood([(ctx, cont)])
    assert sum(lp["token_logprobs"][n_ctx:]) == pytest.approx(ref, abs=1e-4)
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert len(top) == 5 and list(top.values()) == sorted(top.values(), reverse=True)
        assert value <= max(top.values()) + 1e-6
    # the alternatives where the continuation starts: the backend's distribution after the context
    [after] = smol.next_token_logprobs([ctx])
    best = after.topk(5)
    want = dict(zip((t.decode() for t in smol.token_bytes(best.indices.tolist())),
                    best.values.tolist(), strict=True))  # fmt: skip
    got = lp["top_logprobs"][n_ctx]
    assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()),
                                                                           abs=1e-4)  # fmt: skip
    assert lp["token_logprobs"][n_ctx] == max(got.values())  # " Paris" is the greedy choice
    # lm-eval's request: max_tokens 1, logprobs 1; its reading, [ctxlen:-1]
    lm = post(url, "/v1/completions", {**body, "logprobs": 1, "max_tokens": 1, "temperature": 0,
                                        "seed": 1234}).json()["choices"][0]  # fmt: skip
    lml = lm["logprobs"]
    assert len(lml["tokens"]) == len(ids) + 1 and lm["text"].startswith(ctx + cont)
    assert sum(lml["token_logprobs"][n_ctx:-1]) == pytest.approx(ref, abs=1e-4)
    assert all(len(t) == 1 for t in lml["top_logprobs"][1:])
    continuation = zip(lml["token_logprobs"][n_ctx:-1], lml["top_logprobs"][n_ctx:-1], strict=True)
    assert all(v == max(t.values()) for v, t in continuation)  # is_greedy, as lm-eval reads it
    wrong = post(url, "/v1/completions", {**body, "prompt": ctx + " London", "logprobs": 1})
    scores = wrong.json()["choices"][0]["logprobs"]
    assert scores["token_logprobs"][n_ctx] < max(scores["top_logprobs"][n_ctx].values())


def test_top_logprobs_carry_each_tokens_own_bytes(served, smol):
    """C8 (ollama#13497, llama.cpp PR#18454): Chinese and emoji prompts; 20 alternatives come
    back, each with its token's own bytes (no U+FFFD stand-ins), chat and completions."""
    url, _, _ = served
    replacement = list("\ufffd".encode())
    for prompt in ("中国的首都是北", "I love pizza 🍕🍕🍕 and tacos "):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "logprobs": 20}
        out = post(url, "/v1/completions", body).json()
        tops = out["choices"][0]["logprobs"]["top_logprobs"][0]
        assert len(tops) == 20 and "\ufffd" not in tops
        chat_out = chat(url, [{"role": "user", "content": prompt}], max_tokens=2, logprobs=True,
                        top_logprobs=20).json()  # fmt: skip
        entry = chat_out["choices"][0]["logprobs"]["content"][0]
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == 20 and alternatives[0]["token"] == entry["token"]
        assert len({bytes(a["bytes"]) for a in alternatives}) == 20
        [lps] = smol.next_token_logprobs([TaskPrompt(user=prompt)])
        ids = lps.topk(20).indices.tolist()
        assert [bytes(a["bytes"]) for a in alternatives] == smol.token_bytes(ids)
        assert all(a["bytes"] != replacement for a in alternatives)
        for a in alternatives:
            assert a["token"] == bytes(a["bytes"]).decode("utf-8", errors="backslashreplace")
    # a character split over tokens: the bytes of the tokens rebuild it
    ids = smol.tokenize("中国的首都是北")
    assert b"".join(smol.token_bytes(ids)).decode() == "中国的首都是北"


def test_the_openai_client_and_langchain_openai_read_the_answers(served):
    """Two standard clients: the official ``openai`` client (create, stream with usage,
    logprobs, completions) and LangChain's ``ChatOpenAI`` (invoke, stream) get the same
    answers as hand-made requests."""
    from langchain_openai import ChatOpenAI
    from openai import OpenAI

    url, _, _ = served
    ref = chat(url, max_tokens=12).json()["choices"][0]["message"]["content"]
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=12)
    assert r.choices[0].message.content == ref
    pieces, last = [], None
    for ch in client.chat.completions.create(model=MODEL, messages=Q, max_tokens=12, stream=True,
                                             stream_options={"include_usage": True}):  # fmt: skip
        last = ch
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
    assert "".join(pieces) == ref and last.usage.completion_tokens == r.usage.completion_tokens
    lp = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=4, logprobs=True,
                                        top_logprobs=3).choices[0].logprobs.content  # fmt: skip
    assert len(lp[0].top_logprobs) == 3 and lp[0].top_logprobs[0].token == lp[0].token
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                  logprobs=3)  # fmt: skip
    assert c.choices[0].text.startswith(" ") and len(c.choices[0].logprobs.top_logprobs[0]) == 3

    llm = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="none", max_tokens=12,
                     temperature=0, max_retries=0)  # fmt: skip
    assert llm.invoke(Q[0]["content"]).content == ref
    assert "".join(c.content for c in llm.stream(Q[0]["content"])) == ref


# ------------------------------------------------------------------ batching


def test_concurrent_requests_are_batched_and_answer_as_alone(served_tiny):
    """Requests arriving together are decoded together (six rows, under the batch cap); each
    answer equals its answer alone (text identical, first-token log-probabilities
    within 1e-4), streamed or not, with the prefix reuse cache on. On the tiny Qwen3, whose
    six answers differ, so an answer read with another row's padding or positions shows."""
    url, server = served_tiny
    prompts = [f"What is {a} plus {b}? Answer with the number." for a, b in
               ((2, 3), (10, 5), (7, 8), (1, 1), (6, 6), (9, 4))]  # fmt: skip
    msg = {"model": TINY, "max_tokens": 40}

    def ask(p):
        out = chat(url, [{"role": "user", "content": p}], **msg, logprobs=True).json()
        return out["choices"][0]["message"]["content"], out["choices"][0]["logprobs"]["content"][0]

    alone = [ask(p) for p in prompts]
    assert len({text for text, _ in alone}) == len(prompts)
    before = len(server.worker.batch_sizes)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    sizes = server.worker.batch_sizes[before:]
    assert 1 < max(sizes) <= len(prompts)
    for (text, first), (t, f) in zip(alone, together, strict=True):
        assert t == text and f["token"] == first["token"]
        assert f["logprob"] == pytest.approx(first["logprob"], abs=1e-4)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda p: streamed(url, "/v1/chat/completions", {
            **msg, "messages": [{"role": "user", "content": p}]})[0], prompts))  # fmt: skip
    assert streams == [text for text, _ in alone]


def test_a_request_joins_the_running_batch_at_the_next_step(served):
    """Continuous batching: a short request sent while a long answer decodes joins its batch
    (steps of two rows) and is answered long before that answer ends, rather than after it;
    both answers equal their answers alone, streamed or not."""
    url, server, steps = served
    short = chat(url, max_tokens=8).json()["choices"][0]["message"]["content"]
    long = chat(url, LONG, max_tokens=120).json()["choices"][0]["message"]["content"]
    assert len(long) > 300  # it decodes its 120 tokens
    for stream in (False, True):
        before = len(server.worker.batch_sizes)
        with cf.ThreadPoolExecutor(2) as pool:
            if stream:
                body = {"model": MODEL, "messages": LONG, "max_tokens": 120}
                first = pool.submit(streamed, url, "/v1/chat/completions", body)
            else:
                first = pool.submit(
                    lambda: chat(url, LONG, max_tokens=120).json()["choices"][0]["message"]
                )
            start = steps.n
            while steps.n < start + 10:  # it is decoding
                time.sleep(0.005)
            joined = chat(url, max_tokens=8).json()["choices"][0]["message"]["content"]
            assert not first.done()  # answered while the long one still decodes
            got = first.result()
        assert joined == short
        assert (got[0] if stream else got["content"]) == long
        sizes = server.worker.batch_sizes[before:]
        assert sizes.count(2) >= 6 and sizes.count(1) >= 100


def test_a_gone_client_leaves_the_batch_and_the_others_answer_as_alone(served):
    """Three clients decoding together; the one streaming a 300-token answer closes its stream
    after three chunks: its row leaves the batch within a step (the model runs only the steps
    the other two answers need), and their answers equal their answers alone."""
    url, server, steps = served
    asks = [Q, [{"role": "user", "content": "Name three colours and describe each."}]]

    def ask(messages):
        return chat(url, messages, max_tokens=40).json()["choices"][0]["message"]["content"]

    alone = [ask(m) for m in asks]
    body = {"model": MODEL, "messages": LONG, "max_tokens": 300, "stream": True}
    with cf.ThreadPoolExecutor(2) as pool:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # the stream's row is decoding
            others = [pool.submit(ask, m) for m in asks]
            n = 0
            for line in lines:
                n += line.startswith("data: ")
                if n == 3:
                    break
            at_close = steps.n
        together = [f.result() for f in others]
    idle(server)
    assert together == alone
    assert steps.n - at_close <= 40 + 2  # the others' steps at most, and one more


@pytest.mark.parametrize("continuous", [True, False])
def test_a_stream_cut_inside_a_character_ends_as_the_answer_not_streamed(smol, continuous):
    """Issue 55, item 4: SmolLM2 answers "中国的首都是" with "一位..." whose second character
    is two byte tokens, so ``max_tokens`` 2 and 4 cut inside a character. Streamed and not
    streamed, the answer ends alike: the same text (the cut character as U+FFFD), ``length``
    and the budget's tokens, with continuous batching and with whole batches (where the held
    back partial character was dropped and the stream said ``stop`` with one token fewer)."""
    app = create_app(smol, MODEL)
    app.state.server.worker.continuous = continuous
    with running(app) as url:
        for budget in (2, 4, 8):
            body = {"model": MODEL, "prompt": "中国的首都是", "max_tokens": budget}
            plain = post(url, "/v1/completions", body).json()
            text, chunks = streamed(
                url, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
            )
            finish = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]]
            assert text == plain["choices"][0]["text"], budget
            assert finish[-1] == plain["choices"][0]["finish_reason"] == "length"
            assert (
                chunks[-2]["usage"] == plain["usage"]
                and plain["usage"]["completion_tokens"] == budget
            )
            assert text.endswith("\ufffd") == (budget != 8)


def test_a_served_remote_model_streams_to_the_end_the_answer_not_streamed_has(smol):
    """Issue 55, item 4: ``ragfix serve`` over a model behind another server (here SmolLM2
    served by a second ``ragfix serve``), without a tokenizer: a stream ends as the same
    request not streamed (text, ``finish_reason``, usage), counted by the upstream server's
    stream usage, where it ended in an error event naming a ``--tokenizer`` serve lacked."""
    from ragfix.backends import load_backend

    with running(create_app(smol, MODEL)) as inner:
        remote = load_backend("vanilla", model=f"openai:{MODEL}", api_base=inner + "/v1")
        assert not remote.has_tokenizer
        with running(create_app(remote, "outer")) as url:
            for budget, stop in ((3, None), (40, "\n")):
                body = {"model": "outer", "prompt": "The capital of France is", "stop": stop,
                        "max_tokens": budget}  # fmt: skip
                plain = post(url, "/v1/completions", body).json()
                text, chunks = streamed(
                    url, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
                )
                assert "error" not in chunks[-2], chunks[-2]
                finish = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]]
                assert text == plain["choices"][0]["text"]
                assert finish[-1] == plain["choices"][0]["finish_reason"]
                assert (
                    chunks[-2]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
                )
            assert finish[-1] == "stop" and plain["usage"]["completion_tokens"] < 40


def test_whole_batches_gather_clients_that_come_back(smol):
    """A backend that does not decode step by step (GALI: its own loop) answers whole batches:
    closed-loop clients out of phase (one client first, three more while its answer runs): the
    three that waited through that batch wait, once the model is free, for the first client's
    next request, so every batch after the first holds all four clients (rather than the one
    that waited always running alone); each answer equals its answer alone (text identical,
    first-token log-probabilities within 1e-4)."""
    from ragfix.backends.gali import GaliBackend

    gali = GaliBackend(smol.model, smol.tokenizer, train_window=96)
    app = create_app(gali, MODEL, max_wait_ms=500)
    server = app.state.server
    assert not server.worker.continuous
    things = ("colour", "fruit", "planet", "river", "metal", "tree", "bird", "sport", "city")
    prompts = [f"Name a {thing}. Answer with one word." for thing in things]
    rounds = [prompts[0:3], prompts[3:5], prompts[5:7], prompts[7:9]]  # client -> its requests
    with running(app) as url:

        def ask(p):
            out = chat(url, [{"role": "user", "content": p}], max_tokens=12, logprobs=True)
            choice = out.json()["choices"][0]
            return choice["message"]["content"], choice["logprobs"]["content"][0]

        alone = {p: ask(p) for p in prompts}
        server.worker.batch_sizes.clear()
        together: dict[str, tuple] = {}

        def client(mine):
            for p in mine:
                together[p] = ask(p)

        with cf.ThreadPoolExecutor(4) as pool:
            first = pool.submit(client, rounds[0])
            # the first client's request is running alone once its batch is counted (the lock
            # alone may still be the last answer's above, held a moment after it was sent)
            while not server.worker.batch_sizes:
                time.sleep(0.001)
            rest = [pool.submit(client, r) for r in rounds[1:]]
            for f in [first, *rest]:
                f.result()
    assert server.worker.batch_sizes == [1, 4, 4]
    for p, (text, top) in alone.items():
        assert together[p][0] == text and together[p][1]["token"] == top["token"]
        assert together[p][1]["logprob"] == pytest.approx(top["logprob"], abs=1e-4)


def test_a_backend_that_cannot_batch_is_queued(tmp_path):
    """Dynamic NTK RoPE scaling answers depend on batch neighbours (``supports_batching``
    False): the server runs concurrent requests one at a time, each answered as alone."""
    from ragfix.backends import load_backend

    folder = tiny_folder(tmp_path / "tiny")
    backend = load_backend("rope-scaled", model=str(folder), device="cpu", rope_type="dynamic")
    assert not backend.supports_batching
    app = create_app(backend, "tiny")
    prompts = [f"Count to {n}." for n in range(2, 7)]
    with running(app) as url:

        def ask(p):
            body = {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 6}
            return post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]

        alone = [ask(p) for p in prompts]
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, prompts))
    assert together == alone
    assert app.state.server.worker.batch_sizes == [1] * (2 * len(prompts))


# ------------------------------------------------------------------ slow clients (issue 45)

#: a request head cut short: what a trickling client has sent when it stalls
PARTIAL_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


class Slow:
    """A raw client on 127.0.0.1: sends ``first`` at once, then (while :func:`feed` runs) one
    byte of ``more`` per round; keeps what the server sends back and when it closed."""

    def __init__(self, port: int, first: bytes = b"", more: bytes = b"", source: str = ""):
        self.sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
        self.start = time.monotonic()
        self.sock.sendall(first)
        self.more, self.reply, self.closed_after = more, b"", None

    def poll(self) -> None:
        """Read what came, note when the server closed, else send the next trickled byte."""
        import select

        if self.closed_after is not None:
            return
        while select.select([self.sock], [], [], 0)[0]:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                self.closed_after = time.monotonic() - self.start
                self.sock.close()
                return
            self.reply += data
        if self.more:
            with contextlib.suppress(OSError):
                self.sock.send(self.more[:1])
            self.more = self.more[1:]

    def error(self) -> tuple[int, dict]:
        """The status and the JSON error of the server's answer."""
        head, _, body = self.reply.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)["error"]


def feed(clients: list[Slow], stop: threading.Event, every: float = 0.2) -> threading.Thread:
    """A thread that polls every client (:meth:`Slow.poll`) every ``every`` seconds until
    ``stop`` is set and all are closed (``clients`` may grow while it runs)."""

    def run():
        while not (stop.is_set() and all(c.closed_after is not None for c in list(clients))):
            for c in list(clients):
                c.poll()
            time.sleep(every)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_slow_clients_are_cut_off_and_the_others_answered(tmp_path, monkeypatch):
    """Issue 45 (1150 trickling connections stopped ``ragfix serve``, API key or not), against
    ``ragfix serve`` itself with a key: 50 clients trickle a request head a byte at a time, one
    connects and sends nothing, one trickles a body. While they hold their connections, a
    standard client is answered; connections over ``--max-connections`` are answered 503 at
    once; each slow head is answered 408 once its deadline is over (the trickled bytes do not
    extend it), the silent one closed, the slow body answered 408 at its own deadline; then the
    server answers as before."""
    from openai import OpenAI

    head_s, body_s, most = 4, 6, 60
    folder = tiny_folder(tmp_path / "tiny")
    monkeypatch.setenv("RAGFIX_API_KEY", "s3cret")
    args = ["--model", str(folder), "--device", "cpu", "--header-timeout", str(head_s),
            "--body-timeout", str(body_s), "--max-connections", str(most),
            "--max-connections-per-client", str(most)]  # fmt: skip
    with serving(*args) as url:
        port = int(url.removesuffix("/v1").rsplit(":", 1)[1])

        def answer() -> int:
            with OpenAI(base_url=url, api_key="s3cret", max_retries=0, timeout=30) as client:
                out = client.chat.completions.create(model=str(folder), messages=Q, max_tokens=3)
            return out.usage.completion_tokens

        assert answer() >= 1  # warm
        body_head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
            + b"Authorization: Bearer s3cret\r\n"
            b"content-type: application/json\r\ncontent-length: 200\r\n\r\n{"
        )
        heads = [Slow(port, PARTIAL_HEAD, b"X-Slow: " + b"y" * 200) for _ in range(50)]
        silent, body = Slow(port), Slow(port, body_head, b" " * 199)
        clients = [*heads, silent, body]
        stop = threading.Event()
        thread = feed(clients, stop)
        try:
            started = min(c.start for c in clients)
            assert answer() >= 1  # while 52 slow clients hold their connections
            assert all(c.closed_after is None for c in clients)
            time.sleep(0.3)  # the answered client's connection closed
            extra = [Slow(port, PARTIAL_HEAD) for _ in range(most - len(clients))]
            clients += extra
            over = Slow(port, PARTIAL_HEAD)
            deadline = time.monotonic() + 2
            while over.closed_after is None and time.monotonic() < deadline:
                over.poll()
                time.sleep(0.01)
            assert over.closed_after is not None and over.closed_after < 1
            status, error = over.error()
            assert status == 503 and error["code"] == "too_many_connections"
            assert f"({most}, ragfix serve --max-connections)" in error["message"]
            assert time.monotonic() - started < head_s  # all of that while the slow ones held
            assert all(c.closed_after is None for c in clients)
        finally:
            stop.set()
            thread.join(timeout=head_s + body_s + 10)
        assert not thread.is_alive()
        for c in [*heads, *extra]:
            assert head_s - 0.1 <= c.closed_after <= head_s + 2
            status, error = c.error()
            assert status == 408 and error["code"] == "request_timeout"
            assert f"did not send its head within {head_s} s" in error["message"]
        assert head_s - 0.1 <= silent.closed_after <= head_s + 2 and silent.reply == b""
        assert body_s - 0.1 <= body.closed_after <= body_s + 2
        status, error = body.error()
        assert status == 408 and f"its body within {body_s} s of its head" in error["message"]
        assert "\n" not in error["message"]
        assert answer() >= 1


def test_one_client_address_cannot_take_every_connection_nor_hold_an_unread_answer(tmp_path):
    """Issue 55, item 7, load-tested on 127.0.0.1: a client at 127.0.0.2 holding its
    ``--max-connections-per-client`` (3 of 8) gets 503 for a fourth, while 127.0.0.1 is
    answered; and a client that asks for a large answer (a 6,000-token prompt echoed with 20
    alternatives a token, megabytes) and never reads it has its connection dropped at the write
    deadline, where it held the connection for as long as it liked."""
    from ragfix.backends import load_backend
    from ragfix.serve_guard import ServeLimits

    tiny = load_backend("vanilla", model=str(tiny_folder(tmp_path / "tiny", window=8192)))
    limits = ServeLimits(max_connections=8, max_connections_per_client=3, write_timeout_s=2)
    with running(create_app(tiny, "tiny"), limits) as url:
        port = int(url.rsplit(":", 1)[1])
        held = [Slow(port, source="127.0.0.2") for _ in range(3)]
        over = Slow(port, source="127.0.0.2")
        deadline = time.monotonic() + 5
        while over.closed_after is None and time.monotonic() < deadline:
            over.poll()
            time.sleep(0.01)
        status, err = over.error()
        assert status == 503 and err["code"] == "too_many_connections"
        assert "this client address holds its most connections (3" in err["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # another address
        for c in held:
            c.sock.close()
        time.sleep(0.3)
        again = Slow(port, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode(),
                     source="127.0.0.2")  # fmt: skip
        deadline = time.monotonic() + 5
        while b"\r\n\r\n" not in again.reply and time.monotonic() < deadline:
            again.poll()
            time.sleep(0.01)
        assert again.reply.startswith(b"HTTP/1.1 200")
        # an answer never read
        prompt = " ".join(["alpha beta gamma"] * 2000)
        body = json.dumps({"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 20,
                           "max_tokens": 0}).encode()  # fmt: skip
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", port))
        stuck.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        stuck.settimeout(120)  # the answer is computed (slowly on a busy machine), then written
        assert stuck.recv(1, socket.MSG_PEEK)  # its first byte arrived, nothing read
        time.sleep(10)  # written until the buffers fill, then the 2 s write deadline closes it
        got = b""
        stuck.settimeout(5)
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while chunk := stuck.recv(1 << 20):
                got += chunk
        stuck.close()
        head, _, rest = got.partition(b"\r\n\r\n")
        size = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE)[1])
        assert head.startswith(b"HTTP/1.1 200") and size > 2_000_000 and len(rest) < size
        assert httpx.get(url + "/health", timeout=10).status_code == 200


@pytest.mark.processes
def test_limits_are_settings_and_the_open_files_they_need_are_reserved(tmp_path):
    """The limits are validated when built; ``reserve_open_files`` raises the soft limit on open
    files to what ``max_connections`` needs (here, in this process, from a lowered soft limit),
    and ``ragfix serve`` refuses in one line, before loading anything, a ``--max-connections``
    the hard limit cannot hold."""
    import os
    import resource
    import subprocess
    import sys

    from pydantic import ValidationError

    from ragfix.serve_guard import (
        OPEN_FILES_RESERVE,
        ServeLimits,
        accept_burst,
        reserve_open_files,
    )

    with pytest.raises(ValidationError, match="header_timeout_s"):
        ServeLimits(header_timeout_s=0)
    with pytest.raises(ValidationError, match="bogus"):
        ServeLimits(bogus=1)
    limits = ServeLimits(max_connections=100)
    need = 100 + 3 * accept_burst(limits) + OPEN_FILES_RESERVE
    assert accept_burst(limits) == 100 and accept_burst(ServeLimits()) == 128
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 10
    assert low < need
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        assert reserve_open_files(limits) == need
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (need, hard)
        assert reserve_open_files(limits) == need  # enough already: left as it is
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))

    cmd = [sys.executable, "-m", "ragfix.cli", "serve", "--model", str(tmp_path / "none"),
           "--max-connections", "1000"]  # fmt: skip
    done = subprocess.run(cmd, preexec_fn=low_limit, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --max-connections 1000 needs 1448 open files and this process may open 512 "
        "(ulimit -Hn): give --max-connections 112 or less, or raise the limit"
    ]


# ------------------------------------------------------------------ passages as documents

DOCS = [
    {"title": "Paris", "text": "Paris is the capital of France."},
    {"title": "Berlin", "text": "Berlin is the capital of Germany."},
    {"text": "Rome is the capital of Italy."},
]
QUESTION = "What is the capital of Germany?"
ASK = [{"role": "user", "content": QUESTION}]


def qa_prompt() -> TaskPrompt:
    """The task prompt a request with :data:`DOCS` and :data:`QUESTION` stands for, built by the
    QA task itself."""
    from ragfix.tasks import QA
    from ragfix.types import Passage

    return QA.prompt(QUESTION, [Passage(**d) for d in DOCS])


def error(r: httpx.Response, status: int = 400) -> dict:
    """The OpenAI error of a refusal (one line)."""
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    return err


def test_documents_are_answered_as_the_qa_task_prompt(served, smol):
    """A chat request with ``documents`` is answered as the backend answers the QA task's prompt
    of its question over those passages (spans included), streamed or not; the usage counts that
    prompt's tokens; the openai client sends them as ``extra_body``. Without ``documents`` the
    same question is another prompt."""
    url, server, _ = served
    prompt = qa_prompt()
    assert len(prompt.passages) == 3 and prompt.passage_texts()[2].startswith(
        "Document [3](Title: )"
    )
    gen = smol.generate([prompt], max_new_tokens=8, stop_at_newline=False)[0]
    local = server.raw_text(gen, False)
    r = chat(url, ASK, documents=DOCS, max_tokens=8)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and local.strip()
    assert body["choices"][0]["message"]["content"] == local
    assert body["usage"]["prompt_tokens"] == gen.prompt_tokens
    body = {"model": MODEL, "messages": ASK, "documents": DOCS, "max_tokens": 8}
    text, _ = streamed(url, "/v1/chat/completions", body)
    assert text == local
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, extra_body={"documents": DOCS}
    )
    assert reply.choices[0].message.content == local
    plain = chat(url, ASK, max_tokens=8).json()
    assert plain["usage"]["prompt_tokens"] < gen.prompt_tokens


BAD_DOCUMENTS = [  # (request fields, param named)
    ({"documents": []}, "documents"),
    ({"documents": "Paris is the capital of France."}, "documents"),
    ({"documents": [{"title": "Paris"}]}, "documents.0.text"),
    ({"documents": [DOCS[0], {"text": 3}]}, "documents.1.text"),
    ({"documents": [DOCS[0], {"text": " \n"}]}, "documents.1.text"),
    ({"documents": [{"text": "x", "title": None}]}, "documents.0.title"),
    ({"documents": [{"text": "x", "url": "https://x"}]}, "documents.0.url"),
    ({"documents": [{"text": "x"}] * 101}, "documents"),
    ({"documents": DOCS, "messages": [{"role": "system", "content": "Be brief."}, *ASK]},
     "messages"),
    ({"documents": DOCS, "messages": [*ASK, {"role": "assistant", "content": "The"}],
      "continue_final_message": True, "add_generation_prompt": False}, "messages"),
    ({"documents": DOCS, "messages": [{"role": "user", "content": "  "}]}, "messages"),
]  # fmt: skip


def test_malformed_documents_are_400s_naming_the_field(served):
    """Documents must be a non-empty list (at most ``max_documents``, 100 by default) of
    ``{"text": non-empty string, "title": optional string}`` with no other keys, sent with one
    user message; anything else is a 400 naming the field, before the model runs."""
    url, server, steps = served
    idle(server)
    before = steps.n
    for fields, param in BAD_DOCUMENTS:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
        err = error(post(url, "/v1/chat/completions", body))
        assert err["param"] == param, (fields, err)
    assert steps.n == before
    assert error(post(url, "/v1/chat/completions", BAD_DOCUMENTS[-4][0] | {
        "model": MODEL, "messages": ASK}))["message"] == (
        "documents holds 101 documents, more than this server's 100 (--max-documents)"
    )  # fmt: skip


def test_order_marginalization_is_served_over_documents(smol):
    """``create_app`` over order marginalization (3 orders): a request with ``documents`` gets the
    answer the local wrapped backend chooses for the QA task prompt over its votes; ``/v1/models``
    carries the orders and that documents are needed, so a ragfix client refuses it at start; a
    request without documents, or a raw completion, is a 400 naming ``documents``
    (``prompt``)."""
    from ragfix.backends import load_backend
    from ragfix.backends.orders import OrderOptions, marginalize_orders
    from ragfix.errors import ConfigError

    options = OrderOptions(orders=3, aggregate="max")
    wrapped = marginalize_orders(smol, options)
    gen = wrapped.generate([qa_prompt()], max_new_tokens=6, stop_at_newline=False)[0]
    assert [v["order"] for v in gen.votes] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    app = create_app(wrapped, MODEL)
    local = app.state.server.raw_text(gen, False)
    with running(app) as url:
        r = chat(url, ASK, documents=DOCS, max_tokens=6)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == local
        # the usage and finish_reason of the answer given, not of the three orders' answers
        own = len(gen.token_ids)
        assert r.json()["usage"]["completion_tokens"] == gen.own_tokens == own < gen.new_tokens
        assert r.json()["choices"][0]["finish_reason"] == ("length" if own == 6 else "stop")
        loose = wrapped.generate([qa_prompt()], max_new_tokens=40, stop_at_newline=False)[0]
        r = chat(url, ASK, documents=DOCS, max_tokens=40)
        # an answer that ended by itself (30 tokens) though the orders' together passed 40
        assert len(loose.token_ids) < 40 <= loose.new_tokens
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] == len(loose.token_ids)
        # streamed, the same request ends alike: text, finish_reason, usage (issue 55, item 4)
        body = {"model": MODEL, "messages": ASK, "documents": DOCS, "max_tokens": 40,
                "stream_options": {"include_usage": True}}  # fmt: skip
        text, chunks = streamed(url, "/v1/chat/completions", body)
        finish = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]]
        assert text == r.json()["choices"][0]["message"]["content"] and finish[-1] == "stop"
        assert chunks[-2]["usage"]["completion_tokens"] == len(loose.token_ids)
        entry = httpx.get(url + "/v1/models").json()["data"][0]
        assert entry["ragfix"]["orders"] == options.model_dump(mode="json")
        assert entry["ragfix_needs_documents"].startswith("this server answers over several")
        # ragfix's own client sends the task's prompt, never documents: refused at start (issue
        # 55, item 6), where every request of its run was a 400
        with pytest.raises(ConfigError, match=r"serves 'smollm2' only to chat requests that send"):
            load_backend("vanilla", model=f"openai:{MODEL}", api_base=url + "/v1")
        err = error(chat(url, ASK, max_tokens=6))
        assert err["param"] == "documents"
        assert err["message"].startswith("this server answers over several orders")
        body = {"model": MODEL, "prompt": "Paris is", "max_tokens": 2}
        assert error(post(url, "/v1/completions", body))["param"] == "prompt"


def test_attention_sort_is_served_over_documents(smol):
    """A backend that reads passages where the prompt says they are (attention-sort) is served:
    a request without documents is a 400 naming ``documents`` before the model runs; one with
    documents gets the backend's own answer to the QA task prompt."""
    from ragfix.backends.attention_sort import AttentionSortBackend

    backend = AttentionSortBackend(smol.model, smol.tokenizer)
    gen = backend.generate([qa_prompt()], max_new_tokens=4, stop_at_newline=False)[0]
    app = create_app(backend, MODEL)
    with running(app) as url:
        err = error(chat(url, ASK, max_tokens=4))
        assert err["param"] == "documents"
        assert err["message"] == (
            "backend 'attention-sort' reads a prompt's passages where the prompt says they are: "
            "send the passages as documents ([{title, text}], the question as the one user "
            "message) to /v1/chat/completions"
        )
        r = chat(url, ASK, documents=DOCS, max_tokens=4)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == app.state.server.raw_text(gen, False)


def test_serve_cli_takes_orders_and_a_span_backend(tmp_path):
    """``ragfix serve --backend attention-sort --orders 3 --orders-design shuffle ...`` starts
    (a span backend is no longer refused at start), reports its orders in ``/v1/models``,
    refuses a request without documents and answers one with them."""
    folder = tiny_folder(tmp_path / "tiny")
    args = ["--model", str(folder), "--backend", "attention-sort", "--device", "cpu",
            "--orders", "3", "--orders-design", "shuffle", "--orders-aggregate", "plurality",
            "--orders-seed", "5", "--max-documents", "3"]  # fmt: skip
    with serving(*args) as base:
        entry = httpx.get(base + "/models").json()["data"][0]
        assert entry["ragfix"]["orders"] == {
            "orders": 3, "design": "shuffle", "aggregate": "plurality", "seed": 5}  # fmt: skip
        assert entry["ragfix"]["backend"] == "attention-sort"
        ask = {"model": str(folder), "messages": ASK, "max_tokens": 2}
        r = httpx.post(base + "/chat/completions", json=ask, timeout=120)
        assert error(r)["param"] == "documents"
        r = httpx.post(base + "/chat/completions", json={**ask, "documents": DOCS}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        r = httpx.post(base + "/chat/completions", json={**ask, "documents": DOCS * 2}, timeout=120)
        assert error(r)["param"] == "documents"


def test_frameworks_refuse_a_backend_that_needs_passage_spans(smol):
    """A framework's LLM component gets rendered text, never passages: ``RagFixLLM`` over
    ``attention-sort`` or ``set-based`` raises a one-line ``ConfigError``; ``create_app`` serves
    them, answering only requests with documents. A backend that declares nothing but refuses a
    plain prompt is treated alike, with its own reason; vanilla and GALI read a plain prompt."""
    from ragfix.backends.attention_sort import AttentionSortBackend
    from ragfix.backends.gali import GaliBackend
    from ragfix.backends.set_based import SetBasedBackend
    from ragfix.errors import ConfigError
    from ragfix.llm import RagFixLLM

    for backend in (AttentionSortBackend(smol.model, smol.tokenizer),
                    SetBasedBackend(smol.model, smol.tokenizer)):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            RagFixLLM(backend)
        assert str(e.value).startswith(
            f"backend {backend.name!r} cannot run under a framework's LLM component"
        )
        assert "\n" not in str(e.value)
        assert create_app(backend, MODEL).state.server.needs_documents == (
            f"backend {backend.name!r} reads a prompt's passages where the prompt says they are"
        )

    class Undeclared(SetBasedBackend):
        needs_passage_spans = False

    reason = (
        "backend 'set-based' reads a prompt's passages as a set and this prompt does not say "
        "where they are (a plain text, or a prompt built without passages): use a task prompt "
        "(ragfix eval, ragfix judge) or another backend"
    )
    with pytest.raises(ConfigError) as e:
        RagFixLLM(Undeclared(smol.model, smol.tokenizer))
    assert str(e.value) == (
        "backend 'set-based' cannot run under a framework's LLM component, whose prompts do not "
        f"say where passages are: {reason}"
    )
    assert (
        create_app(Undeclared(smol.model, smol.tokenizer), MODEL).state.server.needs_documents
        == reason
    )
    for backend in (smol, GaliBackend(smol.model, smol.tokenizer, train_window=96)):
        assert create_app(backend, MODEL).state.server.needs_documents is None
        assert RagFixLLM(backend).backend is backend


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_api_key_is_an_error_not_an_open_server(how, monkeypatch):
    """Issue 45: ``RAGFIX_API_KEY=`` (set, empty) gave an open server on 0.0.0.0 with only a
    warning. An empty or blank key, given as ``--api-key`` or in the environment, is refused in
    one line before any model is loaded (the model named does not exist); so is one given to
    :func:`~ragfix.serve.create_app`."""
    from typer.testing import CliRunner

    from ragfix.cli.app import app
    from ragfix.errors import ConfigError
    from ragfix.serve import check_api_key

    args = ["serve", "--model", "/nowhere", "--host", "0.0.0.0"]
    if how == "flag":
        args += ["--api-key", "  "]
    else:
        monkeypatch.setenv("RAGFIX_API_KEY", "")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    [line] = [x for x in res.output.splitlines() if x.strip()]
    assert "the API key is empty (--api-key or $RAGFIX_API_KEY)" in line
    with pytest.raises(ConfigError, match="the API key is empty"):
        check_api_key("")
    check_api_key("a-key")
    check_api_key(None)


@pytest.mark.parametrize("orders", [False, True])
def test_logprobs_of_a_served_remote_model_are_a_400_not_a_500(orders):
    """Issue 55, item 5: ``ragfix serve`` over a model behind another server (here a fake
    OpenAI server that gives no log-probabilities) answers a request for ``logprobs`` with a 400
    in OpenAI's error format naming ``logprobs``, chat and completions, with ``--orders`` too
    (an ``AttributeError`` and a 500 before); without ``logprobs`` it answers."""
    from fake_openai import FakeOpenAI

    from ragfix.backends import load_backend
    from ragfix.backends.orders import OrderOptions, marginalize_orders

    with FakeOpenAI("ok") as fake:
        remote = load_backend("vanilla", model="openai:fake", api_base=fake.url)
        backend = marginalize_orders(remote, OrderOptions(orders=2, aggregate="plurality"))
        with running(create_app(backend if orders else remote, MODEL)) as url:
            kw = {"documents": DOCS} if orders else {}
            err = error(chat(url, ASK, max_tokens=4, logprobs=True, top_logprobs=2, **kw))
            assert err["param"] == "logprobs" and "gives no log-probabilities" in err["message"]
            assert chat(url, ASK, max_tokens=4, **kw).status_code == 200
            if not orders:
                body = {"model": MODEL, "prompt": "Paris is", "max_tokens": 2, "logprobs": 1}
                assert error(post(url, "/v1/completions", body))["param"] == "logprobs"


def test_ragfix_serve_serves_a_remote_model_with_the_tokenizer_its_hints_name():
    """Issue 55, item 4: ``ragfix serve --model openai:NAME --api-base URL --tokenizer NAME``
    (the flags its hints name, which it lacked): over a server whose streams carry no usage,
    the local tokenizer counts a stream's answer, so it ends as the answer not streamed (where
    it ended in an error event; the fake's non-streamed usage says 12 tokens whatever it
    answers, so only the ending is compared)."""
    from fake_openai import FakeOpenAI

    ask = 'Key: "k"\n"k": "v"'
    with FakeOpenAI("ok") as fake:
        args = ["--model", "openai:fake", "--api-base", fake.url, "--tokenizer", "smollm2"]
        with serving(*args) as url:
            base = url.removesuffix("/v1")
            body = {"model": "openai:fake", "prompt": ask, "max_tokens": 20}
            plain = post(base, "/v1/completions", body).json()
            text, chunks = streamed(
                base, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
            )
    assert text == plain["choices"][0]["text"] == 'v"'
    assert (
        chunks[-2]["usage"]["completion_tokens"] == 2
        and chunks[-3]["choices"][0]["finish_reason"]
        == plain["choices"][0]["finish_reason"]
        == "stop"
    )
