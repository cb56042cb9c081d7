"""A stand-in OpenAI-compatible server on 127.0.0.1 for the remote backend's tests, misbehaving the
way real servers have (the logic of ``cases/turn3/fake_openai_server.py`` of the shared cases,
in a thread of the test process so a test can read what it saw and change its mode).

It answers the KV task correctly (the value of the prompt's key) with ``usage`` figures, on
``/v1/chat/completions`` and ``/v1/completions`` (both also streamed, in the pieces given);
``/v1/models`` lists the model ``fake`` with ``max_model_len`` 8192.

:func:`ctrl_c` runs a ``ragfix`` command against it in a subprocess and presses Ctrl-C once the
server has seen the requests a test waits for.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: what :class:`FakeOpenAI` does per mode (on the requests of ``only``, else answers ``ok``)
MODES = {
    "ok": "answers the KV task, with usage",
    "error200": 'HTTP 200 with an {"error": ...} body and no choices',
    "nullchoices": 'HTTP 200 with "choices": null',
    "emptychoices": 'HTTP 200 with "choices": []',
    "contentnull": "content null, the answer in reasoning_content (a reasoning model)",
    "reasoninglength": 'content "", finish_reason length, reasoning_content present',
    "refusal": "content null and a refusal",
    "hang": "the first `answer_now` requests answered at once, the others when closed",
    "think": "the right value inside <think>...</think>, then a wrong final answer",
    "thinkopen": "<think> and the right value, never closed (the budget ran out thinking)",
    "othermodel": 'the right answer, from "other-model" (a gateway that routed elsewhere)',
    "dated": 'the right answer, from "fake-2024-08-06" (a dated snapshot of the model asked for)',
    "surrogate": "the right answer with a lone UTF-16 surrogate (\\ud800) in its JSON",
    "nullusage": 'usage with "prompt_tokens": null (a partial usage object)',
    "noecho": "log-probabilities of the generated token only, echo ignored (llama.cpp's server)",
}


class LocalServer(ThreadingHTTPServer):
    """A threaded HTTP server on 127.0.0.1 (any free port) for tests. A client that hangs up
    (a connection reset or a broken pipe, e.g. a kept-alive connection closed after the last
    answer) ends its thread silently: the standard server prints that traceback to
    ``sys.stderr``, which is the output a ``CliRunner`` test reads. Any other error is printed."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        """Bind a free port and serve ``handler`` in a daemon thread; :attr:`url` is its
        OpenAI-style base URL (``.../v1``)."""
        super().__init__(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self.shutdown()
        self.server_close()


def send_json(handler: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
    """Answer ``handler``'s request with ``status`` and the JSON document ``data``."""
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def kv_answer(text: str) -> str:
    """The value of the prompt's key (``Key: "k"`` ... ``"k": "v"``), ``Paris`` without one."""
    m = re.search(r'Key: "([^"]+)"', text)
    if not m:
        return "Paris"
    m2 = re.search(rf'"{re.escape(m.group(1))}": "([^"]+)"', text)
    return (m2.group(1) + '"') if m2 else "unknown"


class FakeOpenAI:
    """The server, started when built, stopped by :meth:`close` (or as a context manager).

    Args:
        mode: one of :data:`MODES`.
        prompt_tokens: the ``usage.prompt_tokens`` it reports for a request body (default: a
            third of the prompt's characters).
        only: the request numbers (1-based, in arrival order) that get ``mode``; the others are
            answered ``ok`` (default: all of them).
        answer_now: in mode ``hang``, how many requests are answered at once.
        pieces: what every answer is made of, streamed piece by piece (default: the KV answer,
            streamed in one piece).

    Attributes:
        url: the ``/v1`` base URL.
        received: request numbers in arrival order; ``answered``: those answered so far;
            ``bodies``: the request bodies in arrival order.
    """

    def __init__(
        self,
        mode: str = "ok",
        *,
        prompt_tokens: Callable[[dict], int] | None = None,
        only: set[int] | None = None,
        answer_now: int = 0,
        pieces: list[str] | None = None,
    ) -> None:
        assert mode in MODES, mode
        self.mode, self.only, self.answer_now, self.pieces = mode, only, answer_now, pieces
        self.prompt_tokens = prompt_tokens or (lambda body: max(1, len(_text(body)) // 3))
        self.received: list[int] = []
        self.bodies: list[dict] = []
        self.answered: list[int] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body) -> None:
                send_json(self, status, json.dumps(body).encode())

            def do_GET(self):
                entry = {"id": "fake", "object": "model", "owned_by": "fake"}
                self._send(200, {"object": "list", "data": [{**entry, "max_model_len": 8192}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
                with fake.lock:
                    k = len(fake.received) + 1
                    fake.received.append(k)
                    fake.bodies.append(body)
                mode = fake.mode if fake.only is None or k in fake.only else "ok"
                if mode == "hang" and k > fake.answer_now:
                    fake.release.wait()
                    return
                try:
                    if body.get("stream"):
                        self._stream(body, self.path.endswith("/chat/completions"))
                    else:
                        self._send(200, fake.response(mode, body, self.path))
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    return
                with fake.lock:
                    fake.answered.append(k)

            def _stream(self, body: dict, chat: bool) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                answer = kv_answer(_text(body))
                for piece in fake.pieces or [answer]:
                    choice = {"index": 0, "finish_reason": None}
                    choice.update({"delta": {"content": piece}} if chat else {"text": piece})
                    kind = "chat.completion.chunk" if chat else "text_completion"
                    chunk = {"id": "x", "created": 0, "model": "fake", "choices": [choice],
                             "object": kind}  # fmt: skip
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        self.httpd = LocalServer(Handler)
        self.url = self.httpd.url

    def response(self, mode: str, body: dict, path: str) -> dict:
        """The JSON body of the answer to ``body`` in ``mode``."""
        chat = path.endswith("/chat/completions")
        answer = "".join(self.pieces) if self.pieces else kv_answer(_text(body))
        out = {"id": "x", "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": "fake"}  # fmt: skip
        if mode == "error200":
            return {"error": {"message": "upstream model crashed", "code": 500}}
        message: dict = {"role": "assistant", "content": answer}
        finish = "stop"
        if mode == "contentnull":
            message = {"role": "assistant", "content": None, "reasoning_content": answer}
        elif mode == "reasoninglength":
            message = {"role": "assistant", "content": "", "reasoning_content": "Let me think"}
            finish = "length"
        elif mode == "refusal":
            message = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
        elif mode == "think":
            message["content"] = f"<think>The value is {answer}</think>\n\nI do not know."
        elif mode == "thinkopen":
            message["content"] = f"<think>Let me look. The value is {answer}"
            finish = "length"
        elif mode == "surrogate":
            message["content"] = answer + "\ud800"
        out["model"] = {"othermodel": "other-model", "dated": "fake-2024-08-06"}.get(mode, "fake")
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice.update({"message": message} if chat else {"text": message["content"]})
        if mode == "noecho" and not chat:
            lp = {"tokens": [answer], "token_logprobs": [-0.5], "top_logprobs": None}
            choice["logprobs"] = {**lp, "text_offset": [len(str(body.get("prompt")))]}
        out["choices"] = {"nullchoices": None, "emptychoices": []}.get(mode, [choice])
        n = self.prompt_tokens(body)
        out["usage"] = {"prompt_tokens": n, "completion_tokens": 12, "total_tokens": n + 12}
        if mode == "nullusage":
            out["usage"]["prompt_tokens"] = None
        return out

    def wait_for(self, received: int, answered: int, timeout: float = 60.0) -> None:
        """Block until ``received`` requests arrived and ``answered`` were answered."""
        deadline = time.monotonic() + timeout
        while len(self.received) < received or len(self.answered) < answered:
            assert time.monotonic() < deadline, (self.received, self.answered)
            time.sleep(0.05)

    def close(self) -> None:
        """Release the held requests (they are dropped) and stop serving."""
        self.release.set()
        self.httpd.close()

    def __enter__(self) -> FakeOpenAI:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class CtrlC:
    """What a command did after :func:`ctrl_c` pressed Ctrl-C.

    Attributes:
        rc: its exit code.
        said: its stderr lines that start with ``interrupted``, each with the seconds from the
            signal to the line.
        lines: every stderr line (for the assertions' messages).
    """

    rc: int
    said: list[tuple[float, str]]
    lines: list[str]


#: ``python -c`` code that runs ``python -m ragfix.cli ARGS`` with SIGINT unblocked and handled by
#: Python's default handler, as a command started from a terminal has it. A child inherits an
#: ignored or blocked SIGINT from its parent, and a test process's libraries may have left it so
#: (a command started that way is not interruptible, rightly).
AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'ragfix'; "
    "runpy.run_module('ragfix.cli', run_name='__main__', alter_sys=True)"
)


def ctrl_c(fake: FakeOpenAI, args: list[str], received: int, answered: int) -> CtrlC:
    """Run ``python -m ragfix.cli ARGS`` (one torch thread; SIGINT handled as in a command started
    from a terminal, :data:`AS_FROM_A_TERMINAL`), send it SIGINT once ``fake`` has
    received ``received`` requests and answered ``answered`` (and 1.5 s more, for the last answer
    to reach the client), and wait (at most 60 s) for it to exit. The server holds its held
    requests until ``fake`` is closed, after this returns: a command that exits here did not
    wait for them, however slowly its interpreter shut down on a busy machine (torch and
    LlamaIndex take seconds there).

    Raises:
        AssertionError: it did not exit within 60 s; the message holds its stderr, ending with
            every thread's stack (faulthandler, on the SIGABRT sent then).
    """
    cmd = [sys.executable, "-c", AS_FROM_A_TERMINAL, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.monotonic(), line.decode()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        fake.wait_for(received=received, answered=answered, timeout=120)
        time.sleep(1.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            masks = _signal_masks(proc.pid)
            proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack
            proc.wait(10)
            reader.join(5)
            stacks = "".join(x for _, x in lines)
            raise AssertionError(
                f"no exit 60 s after SIGINT ({masks}; this process: {_signal_masks(os.getpid())});"
                f" its stderr:\n{stacks}"
            ) from None
    finally:
        proc.kill()
    reader.join(5)
    said = [(t - sent, x) for t, x in lines if x.startswith("interrupted")]
    return CtrlC(rc, said, [x for _, x in lines])


def _signal_masks(pid: int) -> str:
    """The signals process ``pid`` blocks, ignores and catches (its main thread's
    ``/proc/PID/status`` lines, hexadecimal masks: SIGINT is bit 1, ``0x2``)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    kept = [x.replace("\t", " ") for x in status if x.startswith(("SigBlk", "SigIgn", "SigCgt"))]
    return ", ".join(kept)


def _text(body: dict) -> str:
    """A request's prompt: the chat messages' contents joined, or the completions prompt."""
    if "messages" in body:
        return " ".join(str(m.get("content")) for m in body["messages"])
    return str(body.get("prompt"))
