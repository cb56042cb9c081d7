"""The ``answer`` judge style (each answer's likelihood as the judge's reply, no letter) checked
against a plain forward pass by hand, and the KV judge pairs whose wrong answer no given passage
supports."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch
from conftest import data_file
from test_judge import PAIRS as JUDGE_PAIRS
from test_report_html import _payload, _text

from ragfix.connectors.pairwise import load_pairs
from ragfix.errors import ConfigError
from ragfix.eval.html_report import load_judge_run, render_report
from ragfix.judge import PairwiseJudge
from ragfix.judge.judge import pair_prompts

PAIRS = JUDGE_PAIRS[:2]  # the right answer once in each slot


def _reply_logprob(backend, prompt, reply: str) -> float:
    """The summed log-probability of ``reply``'s tokens after ``prompt``, from one plain forward
    pass of the transformers model over the whole sequence (no cache, no ragfix scoring)."""
    ctx, cont = backend.encode(prompt), backend.tokenize(reply)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits = backend.model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
    return float(logp[torch.arange(len(cont)), torch.tensor(cont)].sum())


def test_kv_pairs_with_an_unsupported_wrong_answer():
    """Same object, key, right answer and side as the ``context`` pairs of each line; the wrong
    answer is a value of the same record that the object does not show."""
    path = data_file("litm_kv_retrieval_140_keys.jsonl.gz")
    inside = load_pairs(path, 30)
    outside = load_pairs(path, 30, kv_wrong="unsupported")
    assert outside == load_pairs(path, 30, kv_wrong="unsupported")  # seeded
    with gzip.open(path, "rt") as f:
        recs = [json.loads(next(f)) for _ in range(30)]
    for a, b, rec in zip(inside, outside, recs, strict=True):
        assert (a.pair_id, a.question, a.label) == (b.pair_id, b.question, b.label)
        right = b.answer_a if b.label == "A" else b.answer_b
        wrong = b.answer_b if b.label == "A" else b.answer_a
        assert right == rec["value"] and right in b.question
        assert wrong not in b.question  # no given passage holds it
        assert wrong in {v for _, v in rec["ordered_kv_records"]}
    with pytest.raises(ConfigError, match="llmbar_pairs.jsonl.gz: the KV wrong answer applies"):
        load_pairs(data_file("llmbar_pairs.jsonl.gz"), 2, kv_wrong="unsupported")
    with pytest.raises(ConfigError, match="unknown KV wrong answer 'far'"):
        load_pairs(path, 2, kv_wrong="far")


def test_the_answer_style_scores_each_answer_as_the_reply_by_hand(smol):
    """Each order's ``ll_a`` / ``ll_b`` equal a plain forward pass's log-probability of
    ``" " + answer`` after that order's prompt; ``p_a`` is their normalised likelihood, the
    one-order verdict the more likely answer, the logit verdict the two orders' mean; judging the
    pair the other way round mirrors it."""
    judge = PairwiseJudge(smol, style="answer", batch_size=4)
    res = judge.judge_pairs(PAIRS)
    flipped = judge.judge_pairs(
        [p.model_copy(update={"answer_a": p.answer_b, "answer_b": p.answer_a}) for p in PAIRS]
    )
    for pair, r, f in zip(PAIRS, res, flipped, strict=True):
        first, second = pair_prompts(pair, "answer")
        assert first.assistant_prefix == "The better answer is:"
        a1 = _reply_logprob(smol, first, " " + pair.answer_a)
        b1 = _reply_logprob(smol, first, " " + pair.answer_b)
        b2 = _reply_logprob(smol, second, " " + pair.answer_b)
        a2 = _reply_logprob(smol, second, " " + pair.answer_a)
        # slot terms: the original order's first slot holds answer_a, the swapped one's answer_b
        assert (r.original.ll_a, r.original.ll_b) == pytest.approx((a1, b1), abs=1e-3)
        assert (r.swapped.ll_a, r.swapped.ll_b) == pytest.approx((b2, a2), abs=1e-3)
        assert r.original.p_a == pytest.approx(1 / (1 + math.exp(b1 - a1)), abs=1e-4)
        assert r.original.p_a + r.original.p_b == pytest.approx(1.0)
        assert r.verdict_original == ("A" if a1 > b1 else "B")
        assert r.verdict_swapped == ("B" if b2 > a2 else "A")
        p_a = (1 / (1 + math.exp(b1 - a1)) + 1 / (1 + math.exp(b2 - a2))) / 2
        assert r.logit_p_a == pytest.approx(p_a, abs=1e-4)
        assert r.original.raw == "" and r.seconds is not None
        assert f.logit_p_a == pytest.approx(1 - r.logit_p_a, abs=1e-4)
    assert judge.settings()["style"] == "answer"


def test_the_llamaindex_evaluator_reads_the_answer_style_logit_verdict(smol):
    """``RagfixPairwiseEvaluator`` over an ``answer``-style judge: the score is the judge's
    own logit verdict of the pair."""
    from ragfix.judge import RagfixPairwiseEvaluator

    judge = PairwiseJudge(smol, style="answer", batch_size=4)
    ev = RagfixPairwiseEvaluator(judge)
    for pair, res in zip(PAIRS, judge.judge_pairs(PAIRS), strict=True):
        out = ev.evaluate(
            query=pair.question, response=pair.answer_a, second_response=pair.answer_b
        )
        assert res.logit_verdict in ("A", "B")
        assert out.score == {"A": 1.0, "B": 0.0}[res.logit_verdict]
        assert out.passing == (res.logit_verdict == "A")


def test_pine_in_the_answer_style_with_content_letters_is_consistent_by_construction(smol):
    """PINE reads the two answer blocks as a set and, with letters by content, both orders are
    the same prompt: each answer's likelihood is the same in both orders."""
    from ragfix.backends.pine import PineBackend

    pine = PineBackend(smol.model, smol.tokenizer)
    judge = PairwiseJudge(pine, style="answer", labels="content", batch_size=4)
    for r in judge.judge_pairs(PAIRS):
        assert r.original.ll_a == pytest.approx(r.swapped.ll_b, abs=1e-3)
        assert r.original.ll_b == pytest.approx(r.swapped.ll_a, abs=1e-3)
        assert r.consistent


def test_a_judge_run_records_the_style_and_the_kv_wrong_answer(tmp_path, tiny_dir):
    """``run_judge`` on KV records with unsupported wrong answers in the answer style: both
    settings are in config.json and the summary; a rerun with the other wrong answers into the
    same folder is refused, naming the field. A mechanism: the tiny model."""
    from ragfix.errors import ConfigMismatchError
    from ragfix.eval import run_judge

    data = data_file("litm_kv_retrieval_140_keys.jsonl.gz")
    out = tmp_path / "run"
    kw = dict(records="3:5", style="answer", model=tiny_dir, device="cpu")
    res = run_judge(data, out, kv_wrong="unsupported", **kw)
    assert res.pairs == 2
    config = json.loads((out / "config.json").read_text())
    assert (config["style"], config["kv_wrong"]) == ("answer", "unsupported")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kv_wrong"] == "unsupported"
    recs = [json.loads(x) for x in (out / "judgments.jsonl").read_text().splitlines()]
    assert all(r["original"]["ll_a"] is not None for r in recs)
    with pytest.raises(ConfigMismatchError, match="kv_wrong"):
        run_judge(data, out, **kw)
    # the HTML report rebuilds the run's own pairs (unsupported wrong answers, answer prompts)
    judged = load_judge_run(out)
    assert judged.missing == "" and len(judged.records) == 2
    payload = _payload(render_report([], None, [judged]))
    for row in payload["groups"][0]["rows"]:
        pair = judged.pairs[row["key"]]
        assert pair.answer_a not in pair.question or pair.answer_b not in pair.question
        [cell] = row["cells"]
        rec = next(r for r in recs if r["pair_id"] == row["key"])
        first, second = pair_prompts(pair, "answer")
        assert [_text(payload, o["prompt"]) for o in cell["orders"]] == [first.user, second.user]
        assert {o["prefix"].strip() for o in cell["orders"]} == {"The better answer is:"}
        assert [o["ll"] for o in cell["orders"]] == [
            [rec[k]["ll_a"], rec[k]["ll_b"]] for k in ("original", "swapped")
        ]
