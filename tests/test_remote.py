"""A remote model over HTTP (``--model openai:NAME --api-base URL``) and ``ragfix serve``.

A real ``ragfix serve`` subprocess serves the shared tiny seeded model (``tiny_dir``: SmolLM2's
tokenizer, random weights) on 127.0.0.1 (once for the module); ``ragfix eval`` and the Python
API run against it through the official ``openai`` client and are compared with the same runs on
the local backend (computed first, so only one model computes at a time). The verdict judge,
whose letter probabilities a server returns only when the letters are among its top
alternatives, runs against a real ``ragfix serve`` of the real SmolLM2, started for its test.
Failures are real: a small HTTP proxy in front of the server answers 503 to some requests, or
strips the log-probabilities from the answers.
"""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import BUNDLED, data_file
from fake_openai import LocalServer, send_json
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.errors import ConfigError, ModelNotFoundError, RagfixError
from ragfix.types import OVERFLOW

KV = BUNDLED / "kv_16pairs_sample.jsonl.gz"
#: 1 sample x 2 positions of 3 KV pairs
SWEEP = ["--num-docs", "3", "--limit", "1", "--positions", "0,2"]
PAIRS = 2
MODEL = "openai:smollm2"


def _results(out) -> dict:
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    return {(r["sample_id"], r["position"], r["strategy"]): r for r in rows}


def _judgments(out) -> dict:
    rows = [json.loads(x) for x in (out / "judgments.jsonl").read_text().splitlines()]
    return {r["pair_id"]: r for r in rows}


def _cli(*args: str):
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def remote(tiny_dir) -> str:
    """The served tiny model's name for a client: ``openai:`` and its folder."""
    return f"openai:{tiny_dir}"


@pytest.fixture(scope="module")
def local(tmp_path_factory, tiny_dir):
    """The local reference run: a KV sweep with the local vanilla tiny model."""
    d = tmp_path_factory.mktemp("local")
    _cli("eval", str(KV), *SWEEP, "--model", tiny_dir, "--device", "cpu", "--out", str(d / "sweep"))
    return d


def _health(url: str, model: str) -> None:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health") as r:
        assert json.load(r) == {"status": "ok", "model": model}


@pytest.fixture(scope="module")
def server(local, tiny_dir):
    """``ragfix serve --model TINY_DIR`` on a free port of 127.0.0.1; yields its ``/v1`` URL."""
    from ragfix.serve import serving

    with serving("--model", tiny_dir, "--device", "cpu") as url:
        _health(url, tiny_dir)
        yield url


class Proxy:
    """An HTTP proxy on 127.0.0.1 in front of ``target``: answers 503 to the chat requests
    numbered in ``fail`` (1-based) and, with ``strip_logprobs``, removes the log-probabilities
    from the answers; counts what it saw."""

    def __init__(self, target: str, fail=(), strip_logprobs: bool = False):
        self.target, self.fail, self.strip = target.rsplit("/v1", 1)[0], set(fail), strip_logprobs
        self.chat = self.failed = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self, body: bytes | None):
                if self.path.endswith("/completions"):
                    with proxy.lock:
                        proxy.chat += 1
                        number = proxy.chat
                        if number in proxy.fail:
                            proxy.failed += 1
                    if number in proxy.fail:
                        self.send_response(503)
                        self.send_header("content-type", "application/json")
                        self.end_headers()
                        self.wfile.write(b'{"error": {"message": "overloaded", "type": "x"}}')
                        return
                req = urllib.request.Request(
                    proxy.target + self.path,
                    data=body,
                    method=self.command,
                    headers={"content-type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, data = e.code, e.read()
                if proxy.strip and status == 200 and self.path.endswith("/completions"):
                    doc = json.loads(data)
                    for c in doc["choices"]:
                        c["logprobs"] = None
                    data = json.dumps(doc).encode()
                send_json(self, status, data)

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers["content-length"])))

        self.httpd = LocalServer(Handler)
        self.url = self.httpd.url

    def close(self):
        self.httpd.close()


# ------------------------------------------------------------------ settings refused early


def test_remote_settings_are_checked_before_any_request():
    from ragfix.backends import load_backend, validate_backend

    with pytest.raises(ConfigError, match="backend 'gali' changes the model's weights"):
        validate_backend("gali", model=MODEL, api_base="http://127.0.0.1:1/v1")
    with pytest.raises(ConfigError, match="an adapter changes"):
        validate_backend("vanilla", "some/adapter", model=MODEL, api_base="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="api_base"):
        validate_backend("vanilla", model=MODEL, api_base="127.0.0.1:8000")
    with pytest.raises(ValueError, match="concurrency"):
        validate_backend("vanilla", model=MODEL, api_base="http://x/v1", concurrency=0)
    with pytest.raises(RagfixError, match=r"cannot reach http://127\.0\.0\.1:1/v1"):
        load_backend("vanilla", model=MODEL, api_base="http://127.0.0.1:1/v1", max_retries=0)
    res = CliRunner().invoke(app, ["eval", str(KV), "--api-base", "http://x/v1"])
    assert res.exit_code == 2 and "--api-base is for a served model" in res.output
    res = CliRunner().invoke(app, ["eval", str(KV), "--model", MODEL, "--backend", "gali"])
    assert res.exit_code == 2 and "needs --api-base" in res.output


# ------------------------------------------------------------------ the server itself


def test_serve_speaks_openai(server, tiny_dir):
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=server, api_key="none", max_retries=0)
    [entry] = client.models.list().data
    assert entry.id == tiny_dir
    extra = entry.model_extra
    assert extra["max_model_len"] == 2048 and extra["ragfix"]["backend"] == "vanilla"
    assert len(extra["ragfix"]["model"]["fingerprint"]) == 16
    with pytest.raises(NotFoundError) as e:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(BadRequestError, match="maximum context length is 2048") as e:
        client.completions.create(model=tiny_dir, prompt="word " * 9000, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(BadRequestError, match="one user message"):
        client.chat.completions.create(
            model=tiny_dir,
            messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
        )
    with pytest.raises(BadRequestError, match="stop may only be"):
        client.completions.create(model=tiny_dir, prompt="a", stop=["."], max_tokens=2)
    # streaming gives the answer of the non-streamed request, in pieces, then [DONE]: the same
    # raw continuation (this model's starts with a space, kept by both)
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=tiny_dir, messages=msgs, max_tokens=6)
    events = client.chat.completions.create(
        model=tiny_dir, messages=msgs, max_tokens=6, stream=True
    )
    pieces = [e.choices[0].delta.content or "" for e in events]
    assert len(pieces) > 2 and "".join(pieces) == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"


# ------------------------------------------------------------------ sweeps


def test_sweep_through_serve_equals_local_and_resumes(server, local, remote, tmp_path):
    out = tmp_path / "remote"
    _cli("eval", str(KV), *SWEEP, "--model", remote, "--api-base", server, "--out", str(out))
    mine, ref = _results(out), _results(local / "sweep")
    assert mine.keys() == ref.keys() and len(mine) == 2
    for k, r in mine.items():
        assert r["answer"] == ref[k]["answer"] and r["correct"] == ref[k]["correct"]
        assert r["prompt_tokens"] == ref[k]["prompt_tokens"]
        assert r["new_tokens"] == ref[k]["new_tokens"]
        assert r["extra"]["token_counts"] == "server"
        assert r["extra"]["usage"]["prompt_tokens"] == r["prompt_tokens"]
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == remote and config["backend_options"] == {}  # no address
    # the served backend's identity, its weights fingerprint included, binds the folder
    served = config["identity"]["model"]["server"]["ragfix"]
    assert served["model"]["weights"].startswith("files:")
    assert "endpoint" not in config["identity"]["model"]
    # interrupted: one finished cell is lost; the rerun, on another address (the same server
    # behind a proxy) with other call settings, computes only it
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text(lines[0] + "\n")
    from ragfix.eval import run_sweep

    computed = []
    proxy = Proxy(server)
    try:
        run_sweep(
            KV,
            out,
            model=remote,
            backend_options={"api_base": proxy.url, "concurrency": 1, "timeout": 60},
            num_docs=3,
            limit=1,
            positions="0,2",
            on_record=computed.append,
        )
    finally:
        proxy.close()
    kept = json.loads(lines[0])["cell_id"]
    assert [r.cell_id for r in computed] == [
        r["cell_id"] for r in mine.values() if r["cell_id"] != kept
    ]
    assert {k: r["answer"] for k, r in _results(out).items()} == {
        k: r["answer"] for k, r in mine.items()
    }


def test_order_marginalization_through_serve_gives_the_local_votes(
    server, remote, tiny_dir, tmp_path
):
    """The correction for a model behind an endpoint: the same cells over two orders of their
    passages, locally and through the server, give the same votes and the same answers (the
    server's first-token log-probabilities are the confidences; its completions ``echo``
    scores each candidate answer under each order as the local model does)."""
    orders = ["--orders", "2", "--orders-aggregate", "score"]
    local = ("--model", tiny_dir, "--device", "cpu", "--out", str(tmp_path / "l"))
    _cli("eval", str(KV), *SWEEP, *orders, *local)
    served = ("--model", remote, "--api-base", server, "--out", str(tmp_path / "r"))
    res = CliRunner().invoke(app, ["eval", str(KV), *SWEEP, *orders, *served])
    assert res.exit_code == 2 and "give --tokenizer" in res.output  # refused before any cell
    assert not (tmp_path / "r" / "results.jsonl").exists()
    _cli("eval", str(KV), *SWEEP, *orders, *served, "--tokenizer", tiny_dir)
    mine, ref = _results(tmp_path / "r"), _results(tmp_path / "l")
    assert mine.keys() == ref.keys() and len(mine) == 2
    for k, r in mine.items():
        assert r["answer"] == ref[k]["answer"] and r["correct"] == ref[k]["correct"]
        votes, local_votes = r["extra"]["votes"], ref[k]["extra"]["votes"]
        assert [v["answer"] for v in votes] == [v["answer"] for v in local_votes]
        assert [v["order"] for v in votes] == [v["order"] for v in local_votes]
        for v, lv in zip(votes, local_votes, strict=True):
            assert v["confidence"] == pytest.approx(lv["confidence"], abs=1e-3)
            assert v["scores"].keys() == lv["scores"].keys() and v["scores"]
            for name, value in v["scores"].items():
                assert value == pytest.approx(lv["scores"][name], abs=1e-3) and value < 0
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["identity"]["orders"]["orders"] == 2


def test_failed_requests_are_retried(server, local, remote, tmp_path):
    proxy = Proxy(server, fail={2, 3})
    try:
        out = tmp_path / "retried"
        _cli(
            "eval", str(KV), *SWEEP, "--model", remote, "--api-base", proxy.url,
            "--concurrency", "1", "--max-retries", "3", "--out", str(out),
        )  # fmt: skip
        assert proxy.failed == 2 and proxy.chat == 2 + 2  # two cells, two answered 503 first
    finally:
        proxy.close()
    ref = _results(local / "sweep")
    assert {k: r["answer"] for k, r in _results(out).items()} == {
        k: r["answer"] for k, r in ref.items()
    }
    # without retries the failure is one line, and the finished cell is kept
    proxy = Proxy(server, fail={2})
    try:
        res = CliRunner().invoke(
            app,
            ["eval", str(KV), *SWEEP, "--model", remote, "--api-base", proxy.url,
             "--concurrency", "1", "--max-retries", "0", "--out", str(tmp_path / "failed")],
        )  # fmt: skip
    finally:
        proxy.close()
    assert res.exit_code == 2 and "answered HTTP 503" in res.output and "rerun" in res.output
    assert len(_results(tmp_path / "failed")) == 1


def test_window_is_checked_on_the_servers_count(server, remote, tmp_path):
    from ragfix.backends import load_backend
    from ragfix.eval import run_sweep
    from ragfix.tasks import get_task

    summary = run_sweep(
        KV,
        tmp_path / "small",
        model=remote,
        backend_options={"api_base": server, "context_window": 200},
        num_docs=3,
        limit=1,
        positions="0",
    )
    [rec] = _results(tmp_path / "small").values()
    assert rec["flags"] == [OVERFLOW] and rec["answer"] == "" and not rec["correct"]
    assert rec["prompt_tokens"] + get_task("kv").max_new_tokens > 200
    assert rec["extra"]["usage"]["prompt_tokens"] == rec["prompt_tokens"]
    assert summary["excluded_samples"] == 1
    b = load_backend("vanilla", model=remote, api_base=server)
    [gen] = b.generate(["word " * 9000], max_new_tokens=2)
    assert gen.flags == [OVERFLOW] and gen.text == ""
    with pytest.raises(RagfixError, match="give --tokenizer"):
        b.count_tokens("x")
    with pytest.raises(ModelNotFoundError, match="does not serve 'other'"):
        load_backend("vanilla", model="openai:other", api_base=server)


def test_a_served_model_scores_a_continuation_through_completions_echo(server, remote, tiny):
    """``loglikelihood`` of a model behind an endpoint (what ``--orders-aggregate score-max``
    needs): the server's echoed log-probabilities of the continuation's tokens sum to the local
    model's, after characters the vocabulary splits into bytes too (issue 55, item 2: read by
    character offsets they drifted); a token read across the end of the context is refused,
    not half counted."""
    from ragfix.backends import load_backend

    b = load_backend("vanilla", model=remote, api_base=server)
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " Lyon"),
             ("Le prix est de 100 ₹, soit", " un euro"), ("价格是 ₹", " 100 rupees")]  # fmt: skip
    served, mine = b.loglikelihood(pairs), tiny.loglikelihood(pairs)
    assert served == pytest.approx(mine, abs=1e-3) and max(served) < 0
    with pytest.raises(RagfixError, match="across the end of the context"):
        b.loglikelihood([("The capital of Fr", "ance")])  # "France" is one token


def test_the_answer_style_judge_through_serve_scores_as_the_local_judge(
    server, remote, tiny, tiny_dir
):
    """A served judge in the ``answer`` style (each answer scored as the reply through
    completions ``echo``): both orders' answer log-likelihoods equal the local judge's, so its
    verdicts do; without ``--tokenizer`` the chat text cannot be formatted and it says so."""
    from test_judge import PAIRS as JUDGE_PAIRS

    from ragfix.backends import load_backend
    from ragfix.judge import PairwiseJudge

    pairs = JUDGE_PAIRS[:2]
    b = load_backend("vanilla", model=remote, api_base=server, tokenizer=tiny_dir)
    served = PairwiseJudge(b, style="answer").judge_pairs(pairs)
    mine = PairwiseJudge(tiny, style="answer").judge_pairs(pairs)
    for r, m in zip(served, mine, strict=True):
        for o, n in ((r.original, m.original), (r.swapped, m.swapped)):
            assert (o.ll_a, o.ll_b) == pytest.approx((n.ll_a, n.ll_b), abs=1e-3)
        assert (r.verdict_original, r.verdict_swapped) == (m.verdict_original, m.verdict_swapped)
    bare = load_backend("vanilla", model=remote, api_base=server)
    with pytest.raises(RagfixError, match="tokenizer"):
        PairwiseJudge(bare, style="answer").judge_pairs(pairs[:1])


def test_pipeline_sweep_through_serve_equals_local(server, remote, tiny_dir, tmp_path):
    from ragfix.connectors.corpus import DEMO_CORPUS, DEMO_QUESTIONS
    from ragfix.eval.pipeline import run_pipeline_sweep

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(DEMO_CORPUS.read_text().splitlines(keepends=True)[:12]))
    questions = tmp_path / "q.jsonl"
    questions.write_text(DEMO_QUESTIONS.read_text().splitlines()[0] + "\n")
    common = dict(
        corpus=corpus,
        questions=questions,
        strategies=["none", "reverse", "lost-in-the-middle"],
        top_k=3,
        positions="1",
        retriever="bm25",
    )
    opts = {"api_base": server, "tokenizer": tiny_dir}
    run_pipeline_sweep(out=tmp_path / "remote", model=remote, backend_options=opts, **common)
    mine = _results(tmp_path / "remote")
    assert len(mine) == 3 and all(not r["flags"] for r in mine.values())
    assert all(r["extra"]["usage"]["prompt_tokens"] == r["prompt_tokens"] for r in mine.values())
    with pytest.raises(RagfixError, match="attention"):
        run_pipeline_sweep(
            out=tmp_path / "att", model=remote, backend_options=opts,
            **{**common, "strategies": ["attention-sort"]},
        )  # fmt: skip
    # the local reference last (the server idles meanwhile)
    run_pipeline_sweep(out=tmp_path / "local", model=tiny_dir, device="cpu", **common)
    ref = _results(tmp_path / "local")
    assert {k: (r["answer"], r["prompt_position"]) for k, r in mine.items()} == {
        k: (r["answer"], r["prompt_position"]) for k, r in ref.items()
    }


# ------------------------------------------------------------------ judge


def test_judge_through_serve_matches_local(tmp_path):
    """The verdict judge on the real SmolLM2, locally and through its own ``ragfix serve``
    (started after the local run): the letters are among the server's top alternatives, so
    their probabilities are compared (a random tiny model puts them far below)."""
    from ragfix.serve import serving

    data = data_file("llmbar_pairs.jsonl.gz")
    _cli("judge", str(data), "--limit", str(PAIRS), "--device", "cpu",
         "--out", str(tmp_path / "local"))  # fmt: skip
    with serving("--model", "smollm2", "--device", "cpu") as server:
        _health(server, "smollm2")
        out = tmp_path / "judge"
        _cli("judge", str(data), "--limit", str(PAIRS), "--model", MODEL, "--api-base", server,
             "--out", str(out))  # fmt: skip
        mine, ref = _judgments(out), _judgments(tmp_path / "local")
        assert mine.keys() == ref.keys() and len(mine) == PAIRS
        for k, r in mine.items():
            for order in ("original", "swapped"):
                assert r[order]["raw"] == ref[k][order]["raw"]
                assert r[order]["p_a"] == pytest.approx(ref[k][order]["p_a"], abs=1e-4)
                assert r[order]["p_b"] == pytest.approx(ref[k][order]["p_b"], abs=1e-4)
            assert r["logit_verdict"] == ref[k]["logit_verdict"]
            assert r["logit_p_a"] == pytest.approx(ref[k]["logit_p_a"], abs=1e-4)
            assert r["swap_verdict"] == ref[k]["swap_verdict"]
        identity = json.loads((out / "config.json").read_text())["identity"]
        assert identity["model"]["server"]["ragfix"]["model"]["fingerprint"]
        # a server that returns no logprobs: the generated verdicts, and no logit verdict, said so
        proxy = Proxy(server, strip_logprobs=True)
        try:
            res = _cli("judge", str(data), "--limit", "1", "--model", MODEL, "--api-base",
                       proxy.url, "--out", str(tmp_path / "nolp"))  # fmt: skip
        finally:
            proxy.close()
        assert "no logit verdict: the server returned no logprobs" in res.output
        [rec] = _judgments(tmp_path / "nolp").values()
        assert rec["logit_verdict"] is None and rec["original"]["p_a"] is None
        assert rec["original"]["raw"] == ref[rec["pair_id"]]["original"]["raw"]
        shutil.rmtree(tmp_path / "nolp")
