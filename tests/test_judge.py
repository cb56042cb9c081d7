"""Pairwise judge: verdict parsing, unswapping, metrics on hand-built verdicts, the order-free
verdicts, readers on the shared files, the real SmolLM2 judge through the model interface, the
resumable Python API and the CLI end to end."""

from __future__ import annotations

import gzip
import itertools
import json
import math

import pytest
from conftest import data_file, essays
from sklearn.metrics import cohen_kappa_score

from ragfix.connectors.pairwise import (
    detect_format,
    load_llmbar,
    load_pairs,
    load_pandalm,
    load_simple,
    load_swap_judgments,
)
from ragfix.errors import ConfigError, DataError, RagfixError
from ragfix.judge import (
    JudgePair,
    PairwiseJudge,
    agreement,
    cohen_kappa,
    logit_verdict,
    order_metrics,
    parse_verdict,
    repetition_stability,
    summarize,
    summarize_swap_judgments,
    swap_aggregate,
    unswap,
)

# ------------------------------------------------------------------ parsing (real replies)

# replies seen from SmolLM2-135M (verdict style: after the "[[" prefix; explain style: whole)
# and the free forms of larger judges (LLMBar's GPT-4 completions are "Output (a)")
REAL_REPLIES = [
    ("[[" + "A]]", "A"),
    ("[[" + "A]]\nThe", "A"),
    ("[[" + "B]]", "B"),
    ("[[" + "C]]", "tie"),
    ("[[" + "MALE] was", "invalid"),
    ("[[" + "The", "invalid"),
    ("[[" + "A", "A"),  # cut by the token budget right after the letter
    ("[[" + "Assistant B]]", "B"),
    ("[[" + "Ass", "invalid"),
    ("The answer to the user's question is: 19", "invalid"),
    (
        "Your evaluation is thorough and objective. The two responses provided are both "
        "excellent and well-written.",
        "invalid",
    ),
    ("Both answers are fine. Final verdict: [[B]]", "B"),
    ('Output "[[A]]" if assistant A is better, "[[B]]" if assistant B is better', "invalid"),
    ("Output (a)", "A"),
    ("Output (b)", "B"),
    ("Verdict: Assistant B", "B"),
    ("Assistant A's answer is better because it is correct.", "A"),
    ("tie", "tie"),
    ("B.", "B"),
    ("", "invalid"),
]


@pytest.mark.parametrize(("reply", "expected"), REAL_REPLIES)
def test_parse_verdict_on_real_replies(reply, expected):
    assert parse_verdict(reply) == expected


def test_unswap():
    assert [unswap(v) for v in ("A", "B", "tie", "invalid")] == ["B", "A", "tie", "invalid"]


# ------------------------------------------------------------------ metrics, hand-built


def test_every_slot_pair_is_classified_once():
    cases = {
        ("A", "B"): "consistent",
        ("B", "A"): "consistent",
        ("tie", "tie"): "consistent",
        ("A", "A"): "primacy",
        ("A", "tie"): "primacy",
        ("tie", "A"): "primacy",
        ("B", "B"): "recency",
        ("B", "tie"): "recency",
        ("tie", "B"): "recency",
    }
    for v1, v2 in itertools.product(("A", "B", "tie", "invalid"), repeat=2):
        m = order_metrics([(v1, v2)])
        if "invalid" in (v1, v2):
            assert m["valid_pairs"] == 0 and m["position_consistency"] is None
            continue
        kind = cases[(v1, v2)]
        assert m["consistent_pairs"] == (kind == "consistent")
        assert m["primacy_pairs"] == (kind == "primacy")
        assert m["recency_pairs"] == (kind == "recency")
        assert (
            m["preference_fairness"] == {"consistent": 0.0, "primacy": -1.0, "recency": 1.0}[kind]
        )


def test_preference_fairness_and_rates_worked_example():
    # 2 primacy (AA, AC), 1 recency (BB), 1 consistent (AB), 1 with an unreadable order
    m = order_metrics([("A", "A"), ("A", "tie"), ("B", "B"), ("A", "B"), ("invalid", "A")])
    assert m["pairs"] == 5 and m["valid_pairs"] == 4
    assert m["position_consistency"] == pytest.approx(1 / 4)
    # PF_raw = rc*rp - pc*pp = 1*(1/3) - 2*(2/3) = -1; scaled by n = 4
    assert m["preference_fairness"] == pytest.approx(-1 / 4)
    assert m["invalid_rate"] == pytest.approx(1 / 10)
    assert m["tie_rate"] == pytest.approx(1 / 9)
    # decisive single verdicts: A A, B B, A B, A -> 5 of 8 pick the first slot
    assert m["first_slot_win_rate"] == pytest.approx(5 / 8)
    assert 0 < m["pc_low"] < 0.25 < m["pc_high"] < 1


def test_unbiased_judge_has_half_first_slot_wins():
    m = order_metrics([("A", "B"), ("B", "A"), ("A", "B")])
    assert m["position_consistency"] == 1.0
    assert m["first_slot_win_rate"] == 0.5
    assert m["preference_fairness"] == 0.0


def test_judge_that_never_parses_is_reported_not_crashed():
    m = order_metrics([("invalid", "invalid")] * 3)
    assert m["invalid_rate"] == 1.0
    assert m["position_consistency"] is None and m["first_slot_win_rate"] is None


def test_swap_aggregate_is_mtbench_rule():
    assert swap_aggregate("A", "A") == "A"
    assert swap_aggregate("B", "B") == "B"
    assert swap_aggregate("A", "B") == "tie"
    assert swap_aggregate("A", "tie") == "tie"
    assert swap_aggregate("tie", "tie") == "tie"
    assert swap_aggregate("invalid", "A") == "invalid"


def test_cohen_kappa_matches_sklearn_and_agreement():
    y1 = ["A", "B", "A", "tie", "invalid", "B", "A"]
    y2 = ["A", "B", "B", "tie", "A", "B", "B"]
    assert cohen_kappa(y1, y2) == pytest.approx(cohen_kappa_score(y1, y2))
    assert cohen_kappa(["A", "A"], ["A", "A"]) is None
    g = agreement(y1, [*y2[:-1], None])
    assert g["n"] == 6 and g["accuracy"] == pytest.approx(4 / 6) and g["invalid"] == 1
    assert agreement(["A", "B"], [None, None]) is None


def test_repetition_stability():
    assert repetition_stability([["A", "A", "A"], ["A", "B", "A"]]) == pytest.approx(
        (1 + 2 / 3) / 2
    )
    assert repetition_stability([]) is None


# ------------------------------------------------------------------ logit verdict


def test_logit_verdict_is_exactly_order_symmetric():
    probs = [(0.46, 0.12), (0.47, 0.10), (0.25, 0.077), (0.9, 0.0001), (1e-9, 3e-9)]
    for x, y in itertools.permutations(probs, 2):
        v_ab, p_ab = logit_verdict(x, y)
        v_ba, p_ba = logit_verdict(y, x)
        assert v_ba == unswap(v_ab)
        # p(b better) for (a, b) is bit-identical to p(a better) for (b, a)
        p_b = (x[1] / (x[0] + x[1]) + y[0] / (y[0] + y[1])) / 2
        assert p_ba == p_b
    # a judge that always prefers slot A by the same odds gives an exact tie
    assert logit_verdict((0.6, 0.2), (0.6, 0.2)) == ("tie", pytest.approx(0.5))
    assert logit_verdict((0.0, 0.0), (0.5, 0.1))[0] == "invalid"
    # (0.46 / 0.58 + 0.10 / 0.57) / 2 = (0.79310 + 0.17544) / 2
    assert logit_verdict((0.46, 0.12), (0.47, 0.10)) == ("B", pytest.approx(0.484271, abs=1e-6))


# ------------------------------------------------------------------ readers (shared files)


def test_readers_on_data_files():
    llmbar = load_pairs(data_file("llmbar_pairs.jsonl.gz"))
    assert len(llmbar) == 885
    assert llmbar[0].pair_id == "llmbar:LLMBar/Natural:0" and llmbar[0].label == "A"
    assert sum(p.label == "A" for p in llmbar) == 440
    panda = load_pairs(data_file("pandalm_testset_v1.jsonl.gz"))
    assert len(panda) == 999
    labels = [p.label for p in panda]
    assert (labels.count("A"), labels.count("B"), labels.count("tie")) == (422, 472, 105)
    assert sum("empty_answer_a" in p.flags or "empty_answer_b" in p.flags for p in panda) == 54
    assert panda[157].answer_a == "True"  # stored as a JSON boolean in the source
    data_file("mtbench_question.jsonl")
    mt = load_pairs(data_file("mtbench_model_answers_31models.jsonl.gz"))
    assert len(mt) == 80 and sum(p.reference is not None for p in mt) == 30
    assert mt[0].pair_id == "mtbench:81:gpt-4:gpt-3.5-turbo" and mt[0].label is None


def test_shared_swap_judgments_reproduce_gpt4_consistency():
    per_judge = load_swap_judgments(data_file("llmbar_vanilla_swap_judgments.jsonl.gz"))
    assert sorted(per_judge) == sorted(
        ["GPT-4", "ChatGPT", "ChatGPT-0301", "PaLM2", "LLaMA2", "Falcon"]
    )
    gpt4 = summarize_swap_judgments(per_judge["GPT-4"])["generated"]
    assert (gpt4["consistent_pairs"], gpt4["pairs"]) == (389, 419)
    palm = summarize_swap_judgments(per_judge["PaLM2"])["generated"]
    assert palm["valid_pairs"] == 415  # four items with an unreadable order


def _write_jsonl(path, records):
    with gzip.open(path, "wt") if str(path).endswith(".gz") else open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_bad_input_names_file_line_field(tmp_path):
    good = {"question": "q", "answer_a": "x", "answer_b": "y"}
    p = _write_jsonl(tmp_path / "p.jsonl", [good, {**good, "label": "first"}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: label: unknown label 'first'"):
        load_simple(p)
    p = _write_jsonl(tmp_path / "m.jsonl", [{"question": "q", "answer_a": "x"}])
    with pytest.raises(DataError, match=r"m\.jsonl:1: answer_b: missing"):
        load_pairs(p)
    p = _write_jsonl(tmp_path / "u.jsonl", [{"prompt": "q"}])
    with pytest.raises(DataError, match=r"u\.jsonl:1: not a pairwise record"):
        detect_format(p)
    bar = {"input": "q", "output_1": "x", "output_2": "y", "label": 3}
    p = _write_jsonl(tmp_path / "b.jsonl", [bar])
    with pytest.raises(DataError, match=r"b\.jsonl:1: label: unknown label 3"):
        load_llmbar(p)
    panda = {"instruction": "q", "response1": "x", "response2": "y"}
    p = _write_jsonl(tmp_path / "pd.jsonl", [{**panda, "annotator1": 1, "annotator2": 5}])
    with pytest.raises(DataError, match=r"pd\.jsonl:1: annotator2: unknown vote 5"):
        load_pandalm(p)
    # all three annotators differ: no majority, no label
    p = _write_jsonl(
        tmp_path / "pd2.jsonl", [{**panda, "annotator1": 0, "annotator2": 1, "annotator3": 2}]
    )
    assert load_pandalm(p)[0].label is None


def test_flags_and_missing_labels(tmp_path):
    p = _write_jsonl(
        tmp_path / "f.jsonl",
        [
            {"question": "q", "answer_a": "", "answer_b": "y", "label": "B"},
            {"question": "q", "answer_a": "same", "answer_b": "same ", "label": "tie"},
            {"question": "q", "answer_a": "x", "answer_b": "y"},
        ],
    )
    pairs = load_simple(p)
    assert pairs[0].flags == ["empty_answer_a"]
    assert pairs[1].flags == ["identical_answers"]
    assert pairs[2].label is None
    assert pairs[0].pair_id != pairs[2].pair_id


# ------------------------------------------------------------------ the real judge (SmolLM2)

PAIRS = [
    JudgePair(
        pair_id="capital",
        question="What is the capital of France?",
        answer_a="Paris is the capital of France.",
        answer_b="The capital of France is Berlin.",
        label="A",
    ),
    JudgePair(
        pair_id="sum",
        question="What is 2 + 3?",
        answer_a="2 + 3 = 6",
        answer_b="2 + 3 = 5",
        label="B",
    ),
    JudgePair(
        pair_id="same",
        question="Name a colour.",
        answer_a="Blue.",
        answer_b="Blue.",
        label="tie",
    ),
]


@pytest.fixture(scope="module")
def judged(smol):
    judge = PairwiseJudge(smol, repeats=3, batch_size=4)
    swapped = [
        p.model_copy(update={"answer_a": p.answer_b, "answer_b": p.answer_a}) for p in PAIRS[:2]
    ]
    return judge, judge.judge_pairs(PAIRS), judge.judge_pairs(swapped)


def test_real_judge_both_orders_and_logit_symmetry(judged):
    _, res, swapped = judged
    for r, s in zip(res[:2], swapped, strict=True):
        assert r.original.raw == r.original.raw.strip()
        assert r.verdict_original == r.original.slot_verdict
        assert r.original.slot_verdict in ("A", "B", "tie", "invalid")
        assert r.verdict_swapped == unswap(r.swapped.slot_verdict)
        assert 0 < r.original.p_a < 1 and 0 < r.original.p_b < 1
        # judging (b, a) mirrors judging (a, b): same prompts, roles exchanged
        assert s.logit_verdict == unswap(r.logit_verdict)
        assert s.logit_p_a == pytest.approx(1 - r.logit_p_a, abs=1e-5)
        assert len(r.original.samples) == 3
    same = res[2]
    assert same.flags == ["identical_answers"]
    assert same.swap_verdict == "tie" and same.logit_verdict == "tie" and same.consistent
    # the two judged pairs shared one batch: its time split evenly; the tie asked no model
    assert res[0].seconds > 0 and res[0].seconds == res[1].seconds and same.seconds is None


def test_summary_of_real_judgments(judged):
    _, res, _ = judged
    s = summarize([r.model_dump(mode="json") for r in res])
    assert s["pairs"] == 3 and s["labelled"] == 3
    assert s["flags"] == {"identical_answers": 1}
    assert s["agreement"]["logit_calibrated"]["n"] == 3
    assert 0 < s["letter_mass"] <= 1
    assert 1 / 3 <= s["repetition_stability"] <= 1
    assert s["seconds_per_pair"] == pytest.approx(res[0].seconds)  # the mean of the judged two
    for kind in ("generated", "logit"):
        assert s[kind]["pairs"] == 3


def test_first_step_logprobs_equal_next_token_logprobs(smol, judged):
    # the judge's letter probabilities come from generate(first_logprobs=True): on the same
    # prompts (two lengths, so one of them is left padded) they equal next_token_logprobs
    judge, res, _ = judged
    prompts = [
        judge.prompt(PAIRS[0].question, PAIRS[0].answer_a, PAIRS[0].answer_b, None),
        judge.prompt(PAIRS[1].question, PAIRS[1].answer_a, PAIRS[1].answer_b, None),
    ]
    assert len(smol.encode(prompts[0])) != len(smol.encode(prompts[1]))
    gens = smol.generate(
        prompts, first_logprobs=True, max_new_tokens=4, stop_at_newline=False, batch_size=2
    )
    ref = smol.next_token_logprobs(prompts, batch_size=2)
    assert ref.shape == (2, gens[0].first_logprobs.shape[0])
    for g, r in zip(gens, ref, strict=True):
        assert (g.first_logprobs - r).abs().max() < 1e-4
    for r, lp in zip(res[:2], ref, strict=True):
        assert r.original.p_a == pytest.approx(float(lp[judge.token_a].exp()), rel=1e-4)
        assert r.original.p_b == pytest.approx(float(lp[judge.token_b].exp()), rel=1e-4)


def test_judge_prefills_the_pairs_of_a_question_along_their_token_trie(smol):
    # issue 17: both orders of a pair share the prompt up to the first answer, and the pairs of
    # one question share it up to the answers; the judge prefills each shared prefix once and
    # gets the letters of the judge that prefills every prompt alone
    pairs = [
        PAIRS[0],
        PAIRS[1],
        PAIRS[0].model_copy(update={"pair_id": "capital-2", "answer_b": "It is Lyon."}),
    ]
    plain = type(smol)(smol.model, smol.tokenizer)
    plain.supports_prefix_reuse = False
    prefilled = {}
    for name, backend in (("trie", type(smol)(smol.model, smol.tokenizer)), ("plain", plain)):
        generate = backend.generate

        def counting(prompts, _generate=generate, _name=name, **kw):
            gens = _generate(prompts, **kw)
            prefilled[_name] = prefilled.get(_name, 0) + sum(g.prefill_tokens for g in gens)
            return gens

        backend.generate = counting
        prefilled[name + " judgments"] = PairwiseJudge(backend, batch_size=4).judge_pairs(pairs)
    trie, plain_res = prefilled["trie judgments"], prefilled["plain judgments"]
    for t, p in zip(trie, plain_res, strict=True):
        assert (t.original.slot_verdict, t.swapped.slot_verdict) == (
            p.original.slot_verdict,
            p.swapped.slot_verdict,
        )
        for o, q in ((t.original, p.original), (t.swapped, p.swapped)):
            assert o.p_a == pytest.approx(q.p_a, rel=1e-4)
            assert o.p_b == pytest.approx(q.p_b, rel=1e-4)
    # six prompts; the two pairs of the France question come together, so after the first
    # prompt each one prefills only what follows its prefix shared with the one before
    assert prefilled["trie"] < 0.6 * prefilled["plain"]


def test_truncated_judge_scores_letters_on_the_cut_prompt(smol):
    from ragfix.backends.truncated import TruncatedBackend

    # the judge generates 4 tokens in a 64-token window: prompts are cut to 60 tokens; a
    # 61-token window cuts next_token_logprobs' prompts (1 token reserved) to the same 60
    cut_judge = PairwiseJudge(TruncatedBackend(smol.model, smol.tokenizer, train_window=64))
    same_cut = TruncatedBackend(smol.model, smol.tokenizer, train_window=61)
    p = PAIRS[0]
    r = cut_judge.judge(p.question, p.answer_a, p.answer_b)
    prompts = [
        cut_judge.prompt(p.question, p.answer_a, p.answer_b, None),
        cut_judge.prompt(p.question, p.answer_b, p.answer_a, None),
    ]
    assert len(smol.encode(prompts[0])) > 64
    ref = same_cut.next_token_logprobs(prompts)
    full = smol.next_token_logprobs(prompts)
    ta, tb = cut_judge.token_a, cut_judge.token_b
    for o, lp, lf in zip((r.original, r.swapped), ref, full, strict=True):
        assert o.p_a == pytest.approx(float(lp[ta].exp()), rel=1e-4)
        assert o.p_b == pytest.approx(float(lp[tb].exp()), rel=1e-4)
        # the full prompt gives other letter probabilities: the cut is what the judge read
        assert abs(o.p_a - float(lf[ta].exp())) > 1e-3


def test_judge_flags_a_pair_over_the_window_and_judges_the_others_as_before(smol, judged):
    judge, ref, _ = judged
    # a pair whose judge prompt is longer than SmolLM2's 8192-token window (answer B: essays)
    long = JudgePair(
        pair_id="long",
        question="Which answer summarises the essays better?",
        answer_a="They are about startups.",
        answer_b=essays(45_000),
        label="A",
    )
    prompts = [
        judge.prompt(long.question, long.answer_a, long.answer_b, None),
        judge.prompt(long.question, long.answer_b, long.answer_a, None),
    ]
    assert all(smol.fit(tp, max_new_tokens=4).prompt_tokens > 8192 for tp in prompts)
    sent = []
    backend = type(smol)(smol.model, smol.tokenizer)
    generate = backend.generate

    def recording(ps, **kw):
        sent.extend(ps)
        return generate(ps, **kw)

    backend.generate = recording
    seen = []
    pairs = [PAIRS[0], long, *PAIRS[1:]]
    res = PairwiseJudge(backend, repeats=3, batch_size=4).judge_pairs(pairs, on_result=seen.append)
    # the long pair never reached the model: four prompts ran, two pairs in both orders
    assert len(sent) == 4 and all(len(smol.encode(tp)) < 300 for tp in sent)
    over = res[1]
    assert over.pair_id == "long" and over.flags == ["overflow"] and over in seen
    assert (over.original.raw, over.swapped.raw) == ("", "")
    assert over.swap_verdict == "invalid" and not over.consistent and over.logit_verdict is None
    # the other pairs: the same judgments as without the long pair (same batches, same draws)
    for got, want in zip([res[0], *res[2:]], ref, strict=True):
        assert got.model_dump(exclude={"seconds"}) == want.model_dump(exclude={"seconds"})
    # the summary counts the pair and leaves it out of every metric
    with_long = summarize([r.model_dump(mode="json") for r in res])
    without = summarize([r.model_dump(mode="json") for r in ref])
    assert (with_long["pairs"], with_long["overflow_pairs"], without["overflow_pairs"]) == (4, 1, 0)
    assert with_long["labelled"] == 4 and with_long["agreement"]["logit_calibrated"]["n"] == 3
    assert with_long["flags"] == {"identical_answers": 1, "overflow": 1}
    for key in ("generated", "logit", "agreement", "repetition_stability", "letter_mass"):
        assert with_long[key] == without[key], key
    assert with_long["generated"]["pairs"] == 3 and with_long["logit"] is not None


def test_truncated_judge_runs_a_pair_over_its_window_and_flags_it_cut(smol):
    from ragfix.backends.truncated import TruncatedBackend

    # 219 tokens of prompt: cut to the 64-token window by design, judged, flagged cut_to_window
    judge = PairwiseJudge(TruncatedBackend(smol.model, smol.tokenizer, train_window=64))
    [r] = judge.judge_pairs([PAIRS[0]])
    assert r.flags == ["cut_to_window"] and r.original.p_a is not None
    s = summarize([r.model_dump(mode="json")])
    assert s["overflow_pairs"] == 0 and s["generated"]["pairs"] == 1


def test_judge_without_a_token_count_checks_the_window_on_the_tokens_the_model_read(smol):
    """A backend that cannot count tokens beforehand (a remote model without a tokenizer) runs
    every pair; a pair whose prompt the model counted as longer than the window leaves is
    flagged ``overflow`` afterwards, and its replies are dropped."""
    budget = 2
    sizes = [
        [len(smol.encode(PairwiseJudge(smol, style="explain").prompt(p.question, a, b, None)))
         for a, b in ((p.answer_a, p.answer_b), (p.answer_b, p.answer_a))]
        for p in PAIRS[:2]
    ]  # fmt: skip
    window = max(sizes[0]) + budget
    assert max(sizes[1]) + budget > window  # pair 1 has an order one token too long

    class Untokenized(type(smol)):
        has_tokenizer = False
        context_window = window

    backend = Untokenized(smol.model, smol.tokenizer)
    fit = backend.fit(PAIRS[0].question)
    assert fit.prompt_tokens is None and fit.runs
    judge = PairwiseJudge(backend, style="explain", max_new_tokens=budget)
    fits, over = judge.judge_pairs(PAIRS[:2])
    assert fits.flags == []
    assert over.flags == ["overflow"] and over.original.raw == over.swapped.raw == ""


def test_llamaindex_evaluator(judged):
    from llama_index.core.evaluation import BaseEvaluator, EvaluationResult

    from ragfix.judge import RagfixPairwiseEvaluator

    judge, res, _ = judged
    ev = RagfixPairwiseEvaluator(judge)
    assert isinstance(ev, BaseEvaluator)
    out = ev.evaluate(
        query=PAIRS[0].question,
        response=PAIRS[0].answer_a,
        second_response=PAIRS[0].answer_b,
    )
    assert isinstance(out, EvaluationResult)
    assert out.score == {"A": 1.0, "B": 0.0, "tie": 0.5}[res[0].logit_verdict]
    assert "original order" in out.feedback
    tie = ev.evaluate(query="Name a colour.", response="Blue.", second_response="Blue.")
    assert tie.score == 0.5 and tie.passing is None and tie.pairwise_source == "original"
    with pytest.raises(RagfixError, match="second_response"):
        ev.evaluate(query="q", response="a")
    with pytest.raises(ConfigError, match="style='verdict' or style='answer', not 'explain'"):
        RagfixPairwiseEvaluator(PairwiseJudge(judge.backend, style="explain"))


def test_llamaindex_evaluator_reports_a_pair_over_the_window_as_invalid(judged):
    from ragfix.judge import RagfixPairwiseEvaluator

    ev = RagfixPairwiseEvaluator(judged[0])
    out = ev.evaluate(query="Which is better?", response="Short.", second_response=essays(45_000))
    assert out.invalid_result and out.score is None and out.passing is None
    assert out.invalid_reason == (
        "the judge prompt plus its answer budget exceeds the context window"
    )


def test_explain_style_generates_and_parses(smol):
    judge = PairwiseJudge(smol, style="explain", max_new_tokens=6)
    r = judge.judge("What is 2 + 3?", "5", "6")
    assert r.original.p_a is None and r.logit_verdict is None
    assert r.original.slot_verdict == parse_verdict(r.original.raw)
    with pytest.raises(ConfigError, match="style 'verdict'"):
        PairwiseJudge(smol, style="explain", repeats=2)
    with pytest.raises(ConfigError, match="unknown judge style"):
        PairwiseJudge(smol, style="long")


# ------------------------------------------------------------------ Python API


def test_run_judge_resumes_and_records_config_only_after_a_judgment(tmp_path, tiny_dir):
    from ragfix.errors import ConfigMismatchError
    from ragfix.eval import run_judge

    data = data_file("llmbar_pairs.jsonl.gz")
    out = tmp_path / "run"
    # a run that fails before its first judgment (no room for the answer in a 3-token window)
    # leaves no configuration behind: the corrected rerun may use the same folder
    with pytest.raises(ConfigError, match="no room"):
        run_judge(
            data, out, backend="truncated", backend_options={"train_window": 3}, limit=2,
            model=tiny_dir,
        )  # fmt: skip
    assert not (out / "config.json").exists() and not (out / "judgments.jsonl").exists()
    first = run_judge(data, out, limit=2, device="cpu", model=tiny_dir)  # a mechanism
    assert (first.pairs, first.computed, first.reused) == (2, 2, 0)
    lines = (out / "judgments.jsonl").read_text()
    assert sorted(json.loads(x)["pair_id"] for x in lines.splitlines()) == [
        "llmbar:LLMBar/Natural:0",
        "llmbar:LLMBar/Natural:1",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["backend"] == "vanilla" and config["backend_options"] == {}
    assert len(config["identity"]["model"]["fingerprint"]) == 16
    s = next(iter(first.summaries.values()))
    assert s["pairs"] == 2 and s["labelled"] == 2
    # the rerun computes nothing new and reports the same summary
    again = run_judge(data, out, limit=2, device="cpu", model=tiny_dir)
    assert (again.computed, again.reused) == (0, 2)
    assert (out / "judgments.jsonl").read_text() == lines
    assert again.summaries == first.summaries
    with pytest.raises(ConfigMismatchError, match="other settings.*tie_margin"):
        run_judge(data, out, limit=2, tie_margin=0.1, model=tiny_dir)
    with pytest.raises(ConfigError, match="unknown judge style"):
        run_judge(data, tmp_path / "other", style="long")


# ------------------------------------------------------------------ CLI end to end


def test_cli_judge_end_to_end_and_resume(tmp_path):
    from typer.testing import CliRunner

    from ragfix.cli.app import app

    data = _write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {
                "question": p.question,
                "answer_a": p.answer_a,
                "answer_b": p.answer_b,
                "label": p.label,
            }  # fmt: skip
            for p in PAIRS
        ],
    )
    out = tmp_path / "run"
    args = ["judge", str(data), "--out", str(out), "--device", "cpu", "--limit", "2"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "position bias" in r.output and "agreement with human labels" in r.output
    lines = (out / "judgments.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[0])
    assert {"original", "swapped", "swap_verdict", "logit_verdict"} <= set(rec)
    assert "raw" in rec["original"] and "slot_verdict" in rec["swapped"]
    summary = json.loads((out / "summary.json").read_text())
    s = next(iter(summary["judges"].values()))
    assert s["pairs"] == 2
    assert (out / "judge.png").read_bytes()[:4] == b"\x89PNG"
    # resume: the two judged pairs are skipped, the third is judged
    r = CliRunner().invoke(app, args[:-1] + ["3"])
    assert r.exit_code == 0, r.output
    assert "resuming: 2 of 3" in r.output
    assert len((out / "judgments.jsonl").read_text().splitlines()) == 3
    # other settings into the same folder: a one-line error
    r = CliRunner().invoke(app, [*args, "--tie-margin", "0.1"])
    assert r.exit_code == 2 and "other settings" in r.output


def test_cli_from_judgments(tmp_path):
    from typer.testing import CliRunner

    from ragfix.cli.app import app

    data = data_file("llmbar_vanilla_swap_judgments.jsonl.gz")
    r = CliRunner().invoke(app, ["judge", str(data), "--from-judgments", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    judges = json.loads((tmp_path / "summary.json").read_text())["judges"]
    assert judges["GPT-4"]["generated"]["consistent_pairs"] == 389
    assert math.isclose(
        judges["GPT-4"]["generated"]["position_consistency"], 389 / 419, rel_tol=1e-12
    )
    assert (tmp_path / "judge.png").exists()


# ------------------------------------------------------------------ the judge table kind


def _render_judge(tmp_path, summary_file, name):
    """``summary_file`` copied under ``results/`` as ``name`` and rendered into a doc with the
    ``judge`` kind, as docs/judge.md does; returns the doc's text."""
    from ragfix.eval.render import render_files

    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir(exist_ok=True)
    docs.mkdir(exist_ok=True)
    (results / name).write_text(summary_file.read_text())
    doc = docs / "judge.md"
    doc.write_text(f"# Judge\n\n<!-- results:judge ../results/{name} -->\n<!-- /results -->\n")
    assert render_files([doc]) == [doc]
    assert render_files([doc], check=True) == []
    return doc.read_text()


def test_from_judgments_summary_renders_as_the_judge_kind(tmp_path):
    from ragfix.eval.judge_run import summarize_judgments
    from ragfix.eval.render import render_files

    data = data_file("llmbar_vanilla_swap_judgments.jsonl.gz")
    summarize_judgments(data, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["kind"], summary["format"], summary["limit"]) == (
        "ragfix-judge",
        "swap_judgments",
        None,
    )
    text = _render_judge(tmp_path, tmp_path / "run" / "summary.json", "others.json")
    # GPT-4's row, every figure computed here from the raw file (winners in the original
    # numbering: "1" = output_1; in the swapped run output_1 sat in the second slot)
    with gzip.open(data, "rt") as f:
        rows = [r for r in map(json.loads, f) if r["evaluator"] == "GPT-4"]
    w1 = [r["winner_original_order"] for r in rows]
    w2 = [r["winner_swapped_order"] for r in rows]
    labels = [str(r["label"]) for r in rows]
    read = [(a, b) for a, b in zip(w1, w2, strict=True) if a is not None and b is not None]
    consistent = sum(a == b for a, b in read)
    primacy = sum(a == "1" and b == "2" for a, b in read)  # slot A won both times
    recency = sum(a == "2" and b == "1" for a, b in read)
    pf = (recency**2 - primacy**2) / (primacy + recency) / len(read)
    first = sum(a == "1" for a in w1 if a) + sum(b == "2" for b in w2 if b)
    decisive = sum(a is not None for a in w1) + sum(b is not None for b in w2)
    invalid = (w1.count(None) + w2.count(None)) / (2 * len(rows))
    single = [a or "invalid" for a in w1]
    swap = [
        "invalid" if a is None or b is None else a if a == b else "tie"
        for a, b in zip(w1, w2, strict=True)
    ]

    def acc_kappa(vs):
        acc = sum(v == lab for v, lab in zip(vs, labels, strict=True)) / len(rows)
        return f"{acc:.3f} / {cohen_kappa_score(vs, labels):+.3f}"

    row = (
        f"| GPT-4 | {consistent / len(read):.3f} ({consistent}/{len(read)}) | {pf:+.3f} | "
        f"{first / decisive:.3f} | {invalid:.3f} | {acc_kappa(single)} | {acc_kappa(swap)} |"
    )
    assert (consistent, len(read)) == (389, 419)  # the count LLMBar's data gives
    assert row in text
    assert "| judge | PC (consistent/read) | PF | first-slot wins | invalid |" in text
    assert "| PaLM2 | 0.723 (300/415) |" in text  # four items with an unreadable order
    assert "all items of each judge" in text
    # the first 100 items of each judge: the limit is in the file and in the table
    summarize_judgments(data, tmp_path / "run100", limit=100)
    text = _render_judge(tmp_path, tmp_path / "run100" / "summary.json", "others100.json")
    assert "| GPT-4 | 0.950 (95/100) |" in text and "first 100 items of each judge" in text
    # the judge kind is for judge summaries only, and only the judge kind renders them
    doc = tmp_path / "docs" / "judge.md"
    doc.write_text("<!-- results:curve ../results/others.json -->\n<!-- /results -->\n")
    with pytest.raises(DataError, match="judge table kind is for judge result files"):
        render_files([doc])


def test_judged_run_summary_renders_position_bias_and_agreement(tmp_path):
    """A judged run's summary (run_judge) renders as two tables; the judgments are stored
    beforehand (a judge that always picks the first slot), so no model runs."""
    from ragfix.eval import run_judge
    from ragfix.judge import OrderJudgment, combine

    data = data_file("llmbar_pairs.jsonl.gz")
    pairs = load_pairs(data, 2)
    out = tmp_path / "run"
    out.mkdir()
    first = OrderJudgment(raw="A]]", slot_verdict="A", p_a=0.4, p_b=0.1)
    _write_jsonl(
        out / "judgments.jsonl",
        [combine(p, first, first).model_dump(mode="json") for p in pairs],
    )
    result = run_judge(data, out, limit=2, device="cpu")
    assert (result.computed, result.reused) == (0, 2)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["kind"], summary["format"], summary["limit"]) == ("ragfix-judge", "llmbar", 2)
    assert summary["data"] == str(data)
    text = _render_judge(tmp_path, out / "summary.json", "smol.json")
    title = "smollm2 · vanilla as judge: position bias (llmbar_pairs.jsonl.gz, first 2 pairs)"
    assert f"**{title}**" in text
    assert "| generated | 2 | 0.000 (0/2) | -1.000 | 1.000 | 0.000 | 0.000 |" in text
    assert "| logit argmax | 2 | 0.000 (0/2) | -1.000 | 1.000 | 0.000 | 0.000 |" in text
    assert "Mean p(A) + p(B) at the verdict position: 0.500." in text
    labels = [p.label for p in pairs]
    n_a = labels.count("A")
    acc = f"{n_a / 2:.3f}"
    assert f"| single_original | 2 | {acc} |" in text
    assert f"| single_swapped | 2 | {1 - n_a / 2:.3f} |" in text
    assert "| swap_aggregated | 2 | 0.000 | [0.000, 0.658] |" in text  # Wilson 0 / 2; all ties
    assert "| logit_calibrated |" in text and "| logit_original |" in text


def test_move_swap_reads_the_same_labelled_answers_in_the_other_order(smol):
    """swap="move": the second order is the first prompt with its two answer blocks exchanged
    (labels travel). PINE reads them as a set, so both orders give the same letter
    probabilities (within 1e-4) and a consistent verdict; stored in slot terms, the swapped
    order's p_a is the probability of the letter of the answer in the first slot (B)."""
    from ragfix.backends.pine import PineBackend

    pine = PineBackend(smol.model, smol.tokenizer)
    judge = PairwiseJudge(pine, swap="move", batch_size=4)
    first = judge.prompt(PAIRS[0].question, PAIRS[0].answer_a, PAIRS[0].answer_b, None)
    moved = first.reordered([1, 0])
    assert moved.user.index("Assistant B's Answer") < moved.user.index("Assistant A's Answer")
    assert sorted(moved.passage_texts()) == sorted(first.passage_texts())
    for r in judge.judge_pairs(PAIRS[:2]):
        assert r.original.p_a == pytest.approx(r.swapped.p_b, abs=1e-4)
        assert r.original.p_b == pytest.approx(r.swapped.p_a, abs=1e-4)
        assert r.verdict_original == r.verdict_swapped and r.consistent
    assert judge.settings()["swap"] == "move"
    with pytest.raises(ConfigError, match="unknown swap 'flip'"):
        PairwiseJudge(smol, swap="flip")
