"""The remote cases of turn 3 (``cases/turn3/README.md`` of the shared cases): ``ragfix eval
--model openai:fake`` against a stand-in OpenAI-compatible server on 127.0.0.1
(:mod:`fake_openai`) that misbehaves the way real servers have. No model runs: the server answers
the KV task itself; ``--tokenizer smollm2`` loads only the tokenizer."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import struct
import time

import pytest
from conftest import data_file, run_records
from fake_openai import FakeOpenAI, ctrl_c
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.types import (
    EMPTY_ANSWER,
    INVALID_TEXT,
    PROMPT_CUT,
    REASONING_UNFINISHED,
    SERVED_MODEL_MISMATCH,
    TOKEN_COUNT_MISMATCH,
)

#: the case's sweep: 2 KV samples x gold positions 0 and 3 of 4 pairs (4 cells)
SWEEP = ["kv-sample", "--num-docs", "4", "--positions", "0,3", "--limit", "2"]


def _eval(fake: FakeOpenAI, out, *extra: str):
    args = ["eval", *SWEEP, "--model", "openai:fake", "--api-base", fake.url, "--out", str(out)]
    return CliRunner().invoke(app, [*args, *extra])


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def _exact_count():
    """``usage.prompt_tokens`` as the server of the same model counts a chat request: the
    SmolLM2 chat template of its user turn, plus the assistant prefix to continue."""
    from ragfix.backends.hf import chat_text
    from ragfix.models.load import load_tokenizer
    from ragfix.prompts import TaskPrompt

    tok = load_tokenizer("smollm2")

    def count(body: dict) -> int:
        msgs = body["messages"]
        prefix = msgs[1]["content"] if len(msgs) > 1 else ""
        text = chat_text(tok, TaskPrompt(user=msgs[0]["content"], assistant_prefix=prefix))
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


# ------------------------------------------------------------------ C21: empty answers


def test_c21_content_null_answers_are_flagged_with_the_servers_reason_and_not_scored(tmp_path):
    """C21 (mindcraft-bots/mindcraft#789): a reasoning model answers ``content: null`` with the
    answer in ``reasoning_content``. Every cell is flagged ``empty_answer`` with that reason, no
    cell is scored, the summary and the printed table count them, and ``ragfix report`` says
    why there is nothing to compare instead of showing a -1.000 difference."""
    with FakeOpenAI("contentnull") as fake:
        res = _eval(fake, tmp_path / "run")
    assert res.exit_code == 0, res.output
    recs = run_records(tmp_path / "run")
    reason = "content null, finish_reason stop, reasoning_content present"
    assert len(recs) == 4
    for r in recs:
        assert r["flags"] == [EMPTY_ANSWER] and r["answer"] == "" and r["correct"] is False
        assert r["extra"][EMPTY_ANSWER] == reason
    s = _summary(tmp_path / "run")
    assert s["cells"] == 4 and s["scored_cells"] == 0 and s["excluded_samples"] == 2
    assert s["curves"] == {} and s["flags"] == {EMPTY_ANSWER: {"0": 2, "3": 2}}
    assert s["empty_answer_reasons"] == {reason: 4}
    text = " ".join(res.output.split())
    assert "2 sample(s) have a cell that is not scored" in text and "0 of 4 cells scored" in text
    assert f"empty_answer: 4 cell(s), the server gave no answer text ({reason}: 4)" in text
    rep = CliRunner().invoke(app, ["report", str(tmp_path / "run")])
    assert rep.exit_code == 2 and "no scored cell in this run" in rep.output
    assert "empty_answer: 4 cell(s), the server gave no answer text" in rep.output


def test_c21_an_empty_answer_leaves_its_sample_out_at_every_position_only(tmp_path):
    """C21, one cell: the second request (sample 1, position 3) gets ``content: null``; sample 1
    is left out at both positions, sample 2 is scored at both (the server's answers are right)."""
    with FakeOpenAI("contentnull", only={2}) as fake:
        res = _eval(fake, tmp_path / "run", "--concurrency", "1")
    assert res.exit_code == 0, res.output
    recs = run_records(tmp_path / "run")
    assert [r["flags"] for r in recs] == [[], [EMPTY_ANSWER], [], []]
    assert [r["correct"] for r in recs] == [True, False, True, True]
    s = _summary(tmp_path / "run")
    assert s["scored_cells"] == 2 and s["excluded_samples"] == 1
    curve = s["curves"]["vanilla"]["positions"]
    assert [(p["position"], p["n"], p["accuracy"]) for p in curve] == [(0, 1, 1.0), (3, 1, 1.0)]


def test_c21_refusals_and_reasoning_cut_by_length_name_the_servers_reason():
    """C21, the other reasons a server gives no text: a refusal (its text kept in the reason)
    and a reasoning model that spent the budget thinking (``content: ""``, ``finish_reason:
    length``); the completions endpoint says ``content null`` for a ``text: null``."""
    from ragfix.backends import load_backend
    from ragfix.prompts import TaskPrompt

    ask = TaskPrompt(user='Key: "k"\n"k": "v"', max_new_tokens=8)
    for mode, reason in (
        ("refusal", "content null, finish_reason stop, refusal: I can't help with that."),
        ("reasoninglength", "content blank, finish_reason length, reasoning_content present"),
    ):
        with FakeOpenAI(mode) as fake:
            remote = load_backend("vanilla", model="openai:fake", api_base=fake.url)
            [gen] = remote.generate([ask])
        assert gen.text == "" and gen.flags == [EMPTY_ANSWER]
        assert gen.reasons == {EMPTY_ANSWER: reason}
    with FakeOpenAI("contentnull") as fake:  # completions: text null
        remote = load_backend("vanilla", model="openai:fake", api_base=fake.url)
        [gen] = remote.generate(["a raw prompt"])
    assert gen.flags == [EMPTY_ANSWER] and gen.reasons[EMPTY_ANSWER].startswith("content null")


# ------------------------------------------------------------------ C20: cut prompts


def test_c20_a_prompt_the_server_cut_is_not_scored(tmp_path):
    """C20 (ollama/ollama#4967): the server reports 40 prompt tokens where the tokenizer here
    counts about 420: the cell is flagged ``prompt_cut`` (not ``token_count_mismatch``), its
    answer kept but not scored, and its sample left out, as docs/remote.md says."""
    with FakeOpenAI(prompt_tokens=lambda body: 40) as fake:
        res = _eval(fake, tmp_path / "run", "--tokenizer", "smollm2")
    assert res.exit_code == 0, res.output
    recs = run_records(tmp_path / "run")
    for r in recs:
        assert r["flags"] == [PROMPT_CUT] and r["correct"] is False and r["answer"]
        assert r["prompt_tokens"] > 400 and r["extra"]["usage"]["prompt_tokens"] == 40
        assert r["extra"][PROMPT_CUT] == (
            f"the server counted 40 prompt tokens, {r['prompt_tokens']} here"
        )
    s = _summary(tmp_path / "run")
    assert s["scored_cells"] == 0 and s["flags"] == {PROMPT_CUT: {"0": 2, "3": 2}}
    assert "prompt_cut: 4 cell(s), the server cut the prompt" in " ".join(res.output.split())


def test_c20_a_count_within_the_tolerance_stays_a_scored_cell(tmp_path):
    """C20, the other side: vLLM's completions endpoint adds the BOS token (one more than
    here), and a server may count a BOS or a closing newline fewer; within
    :data:`~ragfix.backends.remote.CUT_TOLERANCE` fewer the cell is flagged
    ``token_count_mismatch`` and scored, one more token fewer is a cut."""
    from ragfix.backends.remote import CUT_TOLERANCE

    exact = _exact_count()
    with FakeOpenAI(prompt_tokens=lambda body: exact(body) + 1) as fake:
        res = _eval(fake, tmp_path / "bos", "--tokenizer", "smollm2")
    assert res.exit_code == 0, res.output
    recs = run_records(tmp_path / "bos")
    assert all(r["flags"] == [TOKEN_COUNT_MISMATCH] and r["correct"] for r in recs)
    assert all(r["extra"]["usage"]["prompt_tokens"] == r["prompt_tokens"] + 1 for r in recs)
    s = _summary(tmp_path / "bos")
    assert s["scored_cells"] == 4 and s["curves"]["vanilla"]["mean"] == 1.0
    for fewer, flag in ((CUT_TOLERANCE, TOKEN_COUNT_MISMATCH), (CUT_TOLERANCE + 1, PROMPT_CUT)):
        with FakeOpenAI(prompt_tokens=lambda body, k=fewer: exact(body) - k) as fake:
            res = _eval(fake, tmp_path / f"fewer{fewer}", "--tokenizer", "smollm2")
        assert res.exit_code == 0, res.output
        assert {f for r in run_records(tmp_path / f"fewer{fewer}") for f in r["flags"]} == {flag}
    with FakeOpenAI(prompt_tokens=exact) as fake:  # the same count: no flag
        res = _eval(fake, tmp_path / "same", "--tokenizer", "smollm2")
    assert res.exit_code == 0 and all(not r["flags"] for r in run_records(tmp_path / "same"))


# ------------------------------------------------------------------ C19: error bodies


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("error200", "answered a chat request (HTTP 200) with an error: upstream model crashed"),
        ("nullchoices", "answered a chat request without choices (choices: null)"),
        ("emptychoices", "answered a chat request without choices (choices: [])"),
    ],
)
def test_c19_an_error_body_is_one_line_naming_the_endpoint_and_its_message(tmp_path, mode, said):
    """C19 (langchain-ai/langchain PR#35236, NVIDIA/garak PR#1760): HTTP 200 with an
    ``{"error": ...}`` body, or ``choices`` null or empty, is one line naming the endpoint and
    what the server said (exit 2), not a ``TypeError`` traceback."""
    with FakeOpenAI(mode) as fake:
        res = _eval(fake, tmp_path / "run")
        url = fake.url
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.startswith("error:")]
    tail = "; nothing to read" if "choices" in said else ""
    assert lines == [f"error: {url} (fake) {said}{tail}"]
    assert "Traceback" not in res.output and "TypeError" not in res.output


def test_a_client_that_resets_its_connection_prints_nothing_into_the_output():
    """The stand-in server runs in the test process, so what its threads print lands in the
    output a ``CliRunner`` test reads (the C19 tests above assert there is no traceback in it).
    A client that resets its kept-alive connection ends the server's thread without a word."""
    with FakeOpenAI("ok") as fake:
        port = fake.httpd.server_address[1]
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            seen = b""
            while b"fake" not in seen:  # the head and the body come in two writes
                seen += client.recv(65536)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # linger 0: the close sends RST, the server's readline is reset
            time.sleep(0.5)
        assert fake.url.endswith("/v1")
    assert err.getvalue() == ""


def test_c19_the_completions_endpoint_says_the_same():
    """C19 on ``/v1/completions`` (a raw prompt): the same one line."""
    from ragfix.backends import load_backend
    from ragfix.errors import RagfixError

    with FakeOpenAI("error200") as fake:
        remote = load_backend("vanilla", model="openai:fake", api_base=fake.url)
        with pytest.raises(RagfixError) as e:
            remote.generate(["a raw prompt"])
    assert str(e.value) == (
        f"{fake.url} (fake) answered a completions request (HTTP 200) with an error: "
        "upstream model crashed"
    )


# ------------------------------------------------------------------ C18: Ctrl-C


def test_c18_ctrl_c_stops_at_once_and_keeps_the_answers_that_arrived(tmp_path):
    """C18 (python/cpython#125886): Ctrl-C while four requests are in flight, one of them
    answered and three held by the server: ``ragfix eval`` says so within a second, exits
    without waiting for the held ones, keeps the answer that arrived (and says how many), and
    the rerun computes only the other three."""
    out = tmp_path / "run"
    with FakeOpenAI("hang", answer_now=1) as fake:
        args = ["eval", *SWEEP, "--model", "openai:fake", "--api-base", fake.url,
                "--concurrency", "4", "--out", str(out)]  # fmt: skip
        stop = ctrl_c(fake, args, received=4, answered=1)
        assert stop.rc == 130 and len(stop.said) == 1, stop.lines
        assert stop.said[0][0] < 1.0, stop.said  # stopped and said so within a second
        assert stop.said[0][1].startswith(
            "interrupted: 1 cell(s) computed by this run are stored"
        ), stop.said
        assert len(fake.received) == 4 and fake.answered == [1], (fake.received, fake.answered)
    [kept] = run_records(out)
    assert kept["correct"] and not kept["flags"]
    with FakeOpenAI() as fake:
        res = _eval(fake, out)
        assert res.exit_code == 0, res.output
        assert "resuming: 1 of 4 cells already done" in res.output and len(fake.received) == 3
    assert len(run_records(out)) == 4


def _judgments(out) -> list[dict]:
    return [json.loads(x) for x in (out / "judgments.jsonl").read_text().splitlines()]


def _judge(fake: FakeOpenAI, out, *extra: str) -> list[str]:
    """``ragfix judge`` of the first 3 LLMBar pairs by ``openai:fake`` into ``out`` (CLI args)."""
    data = data_file("llmbar_pairs.jsonl.gz")
    return ["judge", str(data), "--limit", "3", "--model", "openai:fake", "--api-base", fake.url,
            "--out", str(out), *extra]  # fmt: skip


def test_c18_judge_ctrl_c_stores_every_pair_both_of_whose_replies_arrived(tmp_path):
    """C18 for ``ragfix judge``: three pairs (six prompts) in one batch, one request at a time,
    the server answering four and holding the fifth. Ctrl-C stores the two pairs both of whose
    replies arrived (not the one with only its first), judged exactly as without the stop, says
    so within a second, and the rerun asks only for the third pair's two orders."""
    out = tmp_path / "run"
    with FakeOpenAI("hang", answer_now=4) as fake:
        args = _judge(fake, out, "--concurrency", "1", "--batch-size", "6")
        stop = ctrl_c(fake, args, received=5, answered=4)
        assert stop.rc == 130 and len(stop.said) == 1, stop.lines
        assert stop.said[0][0] < 1.0, stop.said
        said = " ".join(stop.said[0][1].split())
        assert said.startswith(f"interrupted: 2 pair(s) computed by this run are stored in {out}")
        assert fake.received == [1, 2, 3, 4, 5] and fake.answered == [1, 2, 3, 4]
    assert len(_judgments(out)) == 2
    with FakeOpenAI() as fake:
        res = CliRunner().invoke(app, _judge(fake, out, "--batch-size", "6"))
        assert res.exit_code == 0, res.output
        assert "resuming: 2 of 3 pairs already judged" in res.output and len(fake.received) == 2
    with FakeOpenAI() as fake:  # the same pairs judged without a stop
        res = CliRunner().invoke(app, _judge(fake, tmp_path / "ref", "--batch-size", "6"))
        assert res.exit_code == 0, res.output

    def by_id(folder) -> dict:
        return {r["pair_id"]: {**r, "seconds": None} for r in _judgments(folder)}

    assert by_id(out) == by_id(tmp_path / "ref")


def test_c18_pipeline_ctrl_c_stores_the_cells_that_finished(tmp_path):
    """C18 for the pipeline sweep (``ragfix eval-pipeline --corpus --questions``): one question x
    gold ranks 0 and 1 x strategies none and reverse (4 cells, one request each, in turn), the
    server answering two and holding the third. Ctrl-C stores the two finished cells, says so within
    a second, and the rerun computes only the other two."""
    from ragfix.connectors.corpus import DEMO_CORPUS, DEMO_QUESTIONS

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(DEMO_CORPUS.read_text().splitlines(keepends=True)[:12]))
    questions = tmp_path / "q.jsonl"
    questions.write_text(DEMO_QUESTIONS.read_text().splitlines()[0] + "\n")
    out = tmp_path / "run"

    def args(fake: FakeOpenAI) -> list[str]:
        return ["eval-pipeline", "--corpus", str(corpus), "--questions", str(questions),
                "--strategy", "none,reverse", "--num-docs", "3", "--positions", "0,1",
                "--retriever", "bm25",
                "--model", "openai:fake", "--api-base", fake.url, "--tokenizer", "smollm2",
                "--out", str(out)]  # fmt: skip

    with FakeOpenAI("hang", answer_now=2) as fake:
        stop = ctrl_c(fake, args(fake), received=3, answered=2)
        assert stop.rc == 130 and len(stop.said) == 1, stop.lines
        assert stop.said[0][0] < 1.0, stop.said
        said = " ".join(stop.said[0][1].split())
        assert said.startswith(f"interrupted: 2 cell(s) computed by this run are stored in {out}")
        assert fake.received == [1, 2, 3] and fake.answered == [1, 2]
    assert len(run_records(out)) == 2
    with FakeOpenAI() as fake:
        res = CliRunner().invoke(app, args(fake))
        assert res.exit_code == 0, res.output
        assert "resuming: 2 of 4 cells already done" in res.output and len(fake.received) == 2
    assert len(run_records(out)) == 4


def test_c21_a_judge_that_answers_content_null_says_why_its_verdicts_are_invalid(tmp_path):
    """C21 for ``ragfix judge``: a reasoning model answers every judge prompt ``content: null``.
    Each order's verdict is invalid and keeps the server's reason, every pair is flagged
    ``empty_judge_reply`` (not the pair's own ``empty_answer_a``), the summary counts the flag
    and the reasons, and the printed table says why. With one such reply only that pair is
    flagged, on that order."""
    from ragfix.judge import EMPTY_JUDGE_REPLY

    reason = "content null, finish_reason stop, reasoning_content present"
    with FakeOpenAI("contentnull") as fake:
        res = CliRunner().invoke(app, _judge(fake, tmp_path / "run"))
    assert res.exit_code == 0, res.output
    recs = _judgments(tmp_path / "run")
    assert len(recs) == 3
    for r in recs:
        assert r["flags"] == [EMPTY_JUDGE_REPLY] and r["swap_verdict"] == "invalid"
        for order in (r["original"], r["swapped"]):
            assert order["raw"] == "" and order["slot_verdict"] == "invalid"
            assert order["empty_reply_reason"] == reason
    [s] = _summary(tmp_path / "run")["judges"].values()
    assert s["flags"] == {EMPTY_JUDGE_REPLY: 3} and s["empty_reply_reasons"] == {reason: 6}
    assert s["generated"]["invalid_rate"] == 1.0
    text = " ".join(res.output.split())
    assert (
        f"3 pair(s) flagged {EMPTY_JUDGE_REPLY}: the judge model gave no reply text in 6 "
        f"order(s), read as invalid verdicts (the server said {reason}: 6)."
    ) in text
    with FakeOpenAI("contentnull", only={1}) as fake:
        res = CliRunner().invoke(app, _judge(fake, tmp_path / "one", "--concurrency", "1"))
    assert res.exit_code == 0, res.output
    flagged = [r for r in _judgments(tmp_path / "one") if r["flags"]]
    assert [r["flags"] for r in flagged] == [[EMPTY_JUDGE_REPLY]]
    reasons = [o["empty_reply_reason"] for o in (flagged[0]["original"], flagged[0]["swapped"])]
    assert reasons == [reason, None]
    [s] = _summary(tmp_path / "one")["judges"].values()
    assert s["flags"] == {EMPTY_JUDGE_REPLY: 1} and s["empty_reply_reasons"] == {reason: 1}


# ------------------------------------------------------------------ issue 45: what a server says


def test_a_reasoning_models_thinking_is_never_scored(tmp_path):
    """Issue 45: a remote reasoning model writes the right value inside ``<think>...</think>``
    and a wrong final answer. Before, KV scoring found the value in the thinking: accuracy 1.000
    while every final answer was wrong. The thinking is dropped, so every cell is scored on "I do
    not know." and is wrong; an answer whose thinking never closed is flagged
    ``reasoning_unfinished`` and not scored."""
    with FakeOpenAI("think") as fake:
        res = _eval(fake, tmp_path / "think")
    assert res.exit_code == 0, res.output
    recs = run_records(tmp_path / "think")
    assert [(r["answer"], r["correct"], r["flags"]) for r in recs] == [
        ("I do not know.", False, [])
    ] * 4
    assert _summary(tmp_path / "think")["curves"]["vanilla"]["mean"] == 0.0
    with FakeOpenAI("thinkopen") as fake:
        res = _eval(fake, tmp_path / "open")
    assert res.exit_code == 0, res.output
    why = "<think> opened and never closed: no final answer"
    for r in run_records(tmp_path / "open"):
        assert r["flags"] == [REASONING_UNFINISHED] and r["answer"] == ""
        assert r["extra"][REASONING_UNFINISHED] == why
    s = _summary(tmp_path / "open")
    assert s["scored_cells"] == 0 and s["flags"] == {REASONING_UNFINISHED: {"0": 2, "3": 2}}
    text = " ".join(res.output.split())
    assert "reasoning_unfinished: 4 cell(s), the model's reasoning never closed" in text


def test_an_answer_from_another_model_is_flagged_and_a_dated_snapshot_is_not(tmp_path):
    """Issue 45: a gateway answers with another model's name. Every cell is flagged
    ``served_model_mismatch`` with the name it came with and is left out of the curve filed
    under the model asked for; a dated snapshot of the model asked for is the same model."""
    with FakeOpenAI("othermodel") as fake:
        res = _eval(fake, tmp_path / "other")
    assert res.exit_code == 0, res.output
    why = "the server answered as 'other-model', asked for 'fake'"
    for r in run_records(tmp_path / "other"):
        assert r["flags"] == [SERVED_MODEL_MISMATCH] and r["extra"][SERVED_MODEL_MISMATCH] == why
    assert _summary(tmp_path / "other")["scored_cells"] == 0
    with FakeOpenAI("dated") as fake:
        res = _eval(fake, tmp_path / "dated")
    assert res.exit_code == 0, res.output
    assert [(r["flags"], r["correct"]) for r in run_records(tmp_path / "dated")] == [([], True)] * 4
    from ragfix.backends.remote import same_model

    assert same_model("llama3", "llama3:latest") and same_model("gpt-4o", "gpt-4o-2024-08-06")
    assert not same_model("gpt-4o", "gpt-4o-mini") and not same_model("fake", "fake2")


def test_a_lone_surrogate_in_an_answer_is_a_flag_and_the_run_finishes(tmp_path):
    """Issue 45: one lone UTF-16 surrogate in a server's answer crashed the sweep with a
    traceback, storing 0 cells, so the run could never finish. The answer is stored with
    U+FFFD in its place, flagged ``invalid_text`` (not scored), and the run finishes."""
    with FakeOpenAI("surrogate", only={2}) as fake:
        res = _eval(fake, tmp_path / "run", "--concurrency", "1")
    assert res.exit_code == 0, res.output
    recs = run_records(tmp_path / "run")
    assert len(recs) == 4 and [r["flags"] for r in recs] == [[], [INVALID_TEXT], [], []]
    assert recs[1]["answer"].endswith("\ufffd")
    why = "1 lone UTF-16 surrogate(s) in the server's answer, not text (each replaced by U+FFFD)"
    assert recs[1]["extra"][INVALID_TEXT] == why
    assert _summary(tmp_path / "run")["scored_cells"] == 2


@pytest.mark.parametrize(
    ("text", "answer", "unfinished"),
    [
        ('<think>the value is 123</think>\n\n"456"', '"456"', False),
        ("<Thinking>a\nb</Thinking> 456\nmore", "456", False),
        ("opened by the chat template: 123</think>\n456", "456", False),  # Qwen3, DeepSeek-R1
        ("456 <think>but maybe 123</think> then", "456  then", False),
        ("456 <think>but maybe 123", "456", False),
        ("  <think>still thinking: 123", "", True),
        ("  plain 789\nmore", "plain 789", False),
    ],
)
def test_the_reasoning_rule_every_backend_applies(text, answer, unfinished):
    """:func:`~ragfix.backends.base.final_answer` (what the local and remote backends return):
    thinking is dropped wherever it is; thinking that never closed before any answer leaves
    none, flagged ``reasoning_unfinished``."""
    from ragfix.backends.base import final_answer

    got, flags = final_answer(text, stop_at_newline=True)
    assert got == answer and (REASONING_UNFINISHED in flags) is unfinished


def test_a_completions_prompt_leaves_the_bos_to_the_server():
    """A base model's completion form, as a remote backend scores it through the completions
    endpoint (``format_prompt(context) + continuation``), is sent without the BOS that a local
    backend reads first: vLLM and llama.cpp put their own before a completions prompt, and sent
    as text it would be read twice."""
    from fake_openai import FakeOpenAI

    from ragfix.backends import load_backend
    from ragfix.backends.hf import chat_text
    from ragfix.tasks import get_task
    from ragfix.types import Passage

    prompt = get_task("qa").prompt("Who?", [Passage(title="T", text="Ann wrote it.")])
    with FakeOpenAI("ok") as fake:
        remote = load_backend(
            "vanilla", model="openai:fake", api_base=fake.url, tokenizer="gemma3-270m"
        )
    sent = remote.format_prompt(prompt)
    assert sent == prompt.user + prompt.answer_prefix(chat=False) and "<bos>" not in sent
    assert chat_text(remote.tokenizer, prompt) == "<bos>" + sent  # what a local backend reads


@pytest.mark.parametrize("mode", ["ok", "noecho"])
def test_a_server_without_prompt_log_probabilities_is_refused_not_scored_zero(mode, tmp_path):
    """Issue 55, item 1: a server that strips ``logprobs`` (``ok`` here) or ignores ``echo``
    (llama.cpp's server: the generated token's only) gives no score of the answer: the
    log-likelihood refuses in one line, naming the server, where it summed nothing to 0.0;
    through ``--orders-aggregate score-max`` the sweep stops at its first cell."""
    from ragfix.backends import load_backend
    from ragfix.errors import RagfixError

    chat = _exact_count()  # the chat requests' count; a scoring request says 9 prompt tokens
    with FakeOpenAI(mode, prompt_tokens=lambda b: chat(b) if "messages" in b else 9) as fake:
        remote = load_backend(
            "vanilla", model="openai:fake", api_base=fake.url, tokenizer="smollm2"
        )
        with pytest.raises(RagfixError, match=r"\(fake\) gave no log-probability for any"):
            remote.loglikelihood([("Key: k. Value:", " v")])
        res = _eval(fake, tmp_path / "r", "--tokenizer", "smollm2", "--orders", "2")
    assert res.exit_code == 2 and "gave no log-probability for any" in res.output, res.output
    assert not (tmp_path / "r" / "results.jsonl").exists() or not run_records(tmp_path / "r")


def test_a_partial_usage_object_is_read_as_none_and_said_in_one_line():
    """Issue 55, item 8: ``usage`` with ``prompt_tokens: null``: with a tokenizer the answer is
    counted here (no flag); without one the refusal names the partial usage, where a bare
    pydantic validation line ended the run."""
    from ragfix.backends import load_backend
    from ragfix.errors import RagfixError
    from ragfix.prompts import TaskPrompt

    ask = TaskPrompt(user='Key: "k"\n"k": "v"', max_new_tokens=8)
    with FakeOpenAI("nullusage") as fake:
        counted = load_backend(
            "vanilla", model="openai:fake", api_base=fake.url, tokenizer="smollm2"
        )
        [gen] = counted.generate([ask])
        assert (gen.text, gen.flags, gen.usage) == ('v"', [], None)
        assert gen.prompt_tokens == len(counted.encode(ask))
        remote = load_backend("vanilla", model="openai:fake", api_base=fake.url)
        with pytest.raises(RagfixError, match=r"usage without a count \(\{'prompt_tokens': None"):
            remote.generate([ask])


@pytest.mark.parametrize(
    ("headers", "said"),
    [
        ({"Retry-After": "3600"}, "asked to be retried in 1.0 h (Retry-After)"),
        ({"retry-after-ms": "600000"}, "asked to be retried in 10 min (Retry-After)"),
        ({"x-should-retry": "false"}, "not retried (the server said x-should-retry: false)"),
        ({}, "after 2 retries"),
    ],
)
def test_a_429_that_was_not_retried_is_not_reported_as_retried(headers, said):
    """Issue 55, item 8: a 429 whose ``Retry-After`` is longer than the two minutes the client
    waits (or that says ``x-should-retry: false``) is not retried: the error says so and how
    long the server asked for, where it said "after 2 retries" of the one request made; a
    plain 429 is retried and says so."""
    from http.server import BaseHTTPRequestHandler

    from fake_openai import LocalServer, send_json

    from ragfix.backends import load_backend
    from ragfix.errors import RagfixError

    posts = []

    class Busy(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            send_json(self, 200, json.dumps({"data": [{"id": "fake"}]}).encode())

        def do_POST(self):
            posts.append(self.rfile.read(int(self.headers["content-length"])))
            body = json.dumps({"error": {"message": "busy", "type": "rate_limit"}}).encode()
            self.send_response(429)
            for name, value in {**headers, "content-type": "application/json"}.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = LocalServer(Busy)
    try:
        remote = load_backend(
            "vanilla", model="openai:fake", api_base=server.url, tokenizer="smollm2",
            max_retries=2, timeout=30,
        )  # fmt: skip
        with pytest.raises(RagfixError) as e:
            remote.generate(["Paris is"], max_new_tokens=2)
    finally:
        server.close()
    message = str(e.value)
    assert "answered HTTP 429" in message and said in message and "\n" not in message
    assert len(posts) == (3 if not headers else 1)
