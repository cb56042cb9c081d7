"""The judge's letter prior removed: contextual calibration checked by hand, letters assigned by
content (pine consistent under the MT-bench swap), the KV-retrieval judge pairs, and the run
settings that record both."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest
import torch
from conftest import data_file
from test_judge import PAIRS as JUDGE_PAIRS

from ragfix.connectors.pairwise import KV_PAIR_CONTEXT, detect_format, load_pairs
from ragfix.errors import ConfigError
from ragfix.judge import (
    PairwiseJudge,
    check_judge_settings,
    content_free_prior,
    content_labels,
    contextual_calibration,
    letter_probs,
)
from ragfix.judge.judge import CONTENT_FREE_INPUTS, pair_layouts

PAIRS = JUDGE_PAIRS[:2]  # a supported answer in each slot (no tie)


def test_contextual_calibration_matches_a_hand_computation():
    """Zhao et al. 2021 section 4 on hand-made logits: p normalised over the two letters,
    divided by the content-free prior (the mean of the normalised content-free
    distributions), normalised again; computed here with exact fractions."""
    vocab = torch.full((5,), -30.0)
    vocab[1], vocab[2] = torch.tensor(0.3).log(), torch.tensor(0.1).log()
    p = letter_probs(vocab.log_softmax(-1), 1, 2)
    cf_inputs = [(0.6, 0.2), (0.5, 0.5), (0.2, 0.2)]
    prior = content_free_prior(cf_inputs)
    # by hand: normalised content-free A shares 3/4, 1/2, 1/2 -> mean 7/12
    assert prior[0] == pytest.approx(float(Fraction(7, 12)), abs=1e-12)
    assert prior[1] == pytest.approx(float(Fraction(5, 12)), abs=1e-12)
    q = contextual_calibration(p, prior)
    # p = (3/4, 1/4) after normalising; (3/4)/(7/12) = 9/7, (1/4)/(5/12) = 3/5 -> 15/22, 7/22
    assert q[0] == pytest.approx(float(Fraction(15, 22)), abs=1e-6)
    assert q[1] == pytest.approx(float(Fraction(7, 22)), abs=1e-6)
    # a pair that reads exactly like the prior carries no preference after calibration
    assert contextual_calibration((0.7, 0.5), (0.7 / 1.2, 0.5 / 1.2)) == pytest.approx((0.5, 0.5))
    assert contextual_calibration((0.0, 0.0), prior) is None
    with pytest.raises(ConfigError, match="no mass on A or B"):
        content_free_prior([(0.0, 0.0)])


def test_content_labels_follow_the_text_in_both_orders():
    a, b = PAIRS[0].answer_a, PAIRS[0].answer_b
    assert content_labels(a, b) == tuple(reversed(content_labels(b, a)))
    one, two = pair_layouts(PAIRS[0], "relabel", "content")
    assert (one[0], one[1]) == (two[1], two[0])  # each answer keeps its letter
    assert pair_layouts(PAIRS[0], "relabel", "slot") == (("A", "B"), ("A", "B"))
    assert pair_layouts(PAIRS[0], "move", "slot") == (("A", "B"), ("B", "A"))
    with pytest.raises(ConfigError, match="unknown labels 'abc'"):
        check_judge_settings("verdict", 1, labels="abc")
    with pytest.raises(ConfigError, match="unknown calibration 'x'"):
        check_judge_settings("verdict", 1, calibrate="x")
    with pytest.raises(ConfigError, match="needs style 'verdict'"):
        check_judge_settings("explain", 1, calibrate="content-free")


def test_pine_with_content_letters_is_consistent_under_the_mt_bench_swap(smol):
    """With letters by content the answers exchange places and keep their letters: PINE reads
    the same set in both orders, so the one-pass verdict and letter probabilities of the swapped
    order mirror the original's (slot terms) under the default swap, where with slot letters it
    names the first slot every time."""
    from ragfix.backends.pine import PineBackend

    pine = PineBackend(smol.model, smol.tokenizer)
    judge = PairwiseJudge(pine, labels="content", batch_size=4)
    for r in judge.judge_pairs(PAIRS):
        assert r.original.p_a == pytest.approx(r.swapped.p_b, abs=1e-4)
        assert r.original.p_b == pytest.approx(r.swapped.p_a, abs=1e-4)
        assert r.verdict_original == r.verdict_swapped and r.consistent
    assert judge.settings()["labels"] == "content"


def test_calibrated_judge_divides_by_the_content_free_prior_it_measured(smol):
    """The prior of each letter layout equals the mean normalised letter distribution of the
    content-free prompts read through ``next_token_logprobs`` (a second code path), and each
    order's q is p divided by it, by hand; stored in slot terms like p."""
    judge = PairwiseJudge(smol, labels="content", calibrate="content-free", batch_size=4)
    res = judge.judge_pairs(PAIRS)
    assert judge.prior_passes == len(CONTENT_FREE_INPUTS) * len(judge.priors)
    for key, (ca, cb) in judge.priors.items():
        layout = (key[0], key[1])
        prompts = [judge.prompt(cf, cf, cf, None, layout) for cf in CONTENT_FREE_INPUTS]
        lps = smol.next_token_logprobs(prompts)
        shares = []
        for row in lps:
            pa, pb = row[judge.token_a].exp().item(), row[judge.token_b].exp().item()
            shares.append(pa / (pa + pb))
        assert ca == pytest.approx(sum(shares) / len(shares), abs=1e-4)
        assert ca + cb == pytest.approx(1.0)
    for r, p in zip(res, PAIRS, strict=True):
        layouts = pair_layouts(p, "relabel", "content")
        for order, lay in zip((r.original, r.swapped), layouts, strict=True):
            # back to letter terms: slot terms exchanged A and B where B is in the first slot
            pa, pb, qa = (order.p_a, order.p_b, order.q_a)
            if lay[0] == "B":
                pa, pb, qa = order.p_b, order.p_a, order.q_b
            ca, cb = judge.priors["".join(lay)]
            x, y = pa / (pa + pb) / ca, pb / (pa + pb) / cb
            assert qa == pytest.approx(x / (x + y), abs=1e-9)


def test_kv_pairs_are_deterministic_and_supported_by_their_context():
    path = data_file("litm_kv_retrieval_140_keys.jsonl.gz")
    assert detect_format(path) == "kv"
    pairs = load_pairs(path, 40)
    assert pairs == load_pairs(path, 40)  # seeded: the same pairs on every read
    labels = [p.label for p in pairs]
    assert 10 <= labels.count("A") <= 30  # both sides carry the right value
    import gzip

    with gzip.open(path, "rt") as f:
        recs = [json.loads(next(f)) for _ in range(40)]
    for p, rec in zip(pairs, recs, strict=True):
        right = p.answer_a if p.label == "A" else p.answer_b
        wrong = p.answer_b if p.label == "A" else p.answer_a
        assert right == rec["value"] and wrong != right
        assert json.dumps(rec["key"]) in p.question
        # the wrong value is another key's value, in the same JSON object
        assert f": {json.dumps(wrong)}" in p.question
        assert p.question.count('": "') == KV_PAIR_CONTEXT
    assert pairs[0].pair_id == f"kv:1:{recs[0]['key']}"


def test_judge_run_records_letters_and_calibration_and_renders_them(tmp_path, tiny_dir):
    """One KV pair of a record range, letters by content, calibrated: the settings are in
    config.json, a rerun with another calibration is refused before the model loads, and the
    summary renders the calibrated verdicts' row and the prior. A mechanism: the tiny model."""
    from ragfix.errors import ConfigMismatchError
    from ragfix.eval import run_judge
    from ragfix.judge.report import judge_tables

    data = data_file("litm_kv_retrieval_140_keys.jsonl.gz")
    out = tmp_path / "run"
    res = run_judge(
        data, out, records="5:6", labels="content", calibrate="content-free", device="cpu",
        model=tiny_dir,
    )  # fmt: skip
    assert res.pairs == 1
    config = json.loads((out / "config.json").read_text())
    assert (config["labels"], config["calibrate"]) == ("content", "content-free")
    rec = json.loads((out / "judgments.jsonl").read_text())
    assert rec["pair_id"].startswith("kv:6:")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == "5:6" and summary["content_free"]["passes"] >= 3
    s = next(iter(summary["judges"].values()))
    assert s["contextual"]["pairs"] == 1 and s["agreement"]["contextual_original"]["n"] == 1
    text = "\n".join(t.title + str(t.rows) + str(t.lines) for t in judge_tables(summary))
    assert "contextual argmax" in text and "content-free prior" in text
    with pytest.raises(ConfigMismatchError, match="calibrate"):
        run_judge(data, out, records="5:6", labels="content", model=tiny_dir)


def test_compare_runs_is_the_exact_mcnemar_test_of_one_verdict_field(tmp_path):
    """Two hand-made runs on five labelled pairs (and one unlabelled, one overflowing): the other
    run alone is right on 3 pairs, the baseline alone on none -> p = 2 * 0.5**3 = 0.25."""
    from ragfix.eval.judge_run import compare_runs

    base = ["B", "B", "B", "A", "B", "A", "A"]
    other = ["A", "A", "A", "A", "B", "B", "B"]
    labels = ["A", "A", "A", "A", "A", None, "B"]
    for name, verdicts in (("base", base), ("other", other)):
        (tmp_path / name).mkdir()
        rows = [
            {
                "pair_id": f"p{i}",
                "label": lab,
                "verdict_original": v,
                "flags": ["overflow"] if i == 6 else [],
            }
            for i, (v, lab) in enumerate(zip(verdicts, labels, strict=True))
        ]
        lines = "".join(json.dumps(r) + "\n" for r in rows)
        (tmp_path / name / "judgments.jsonl").write_text(lines)
    got = compare_runs(tmp_path / "base", tmp_path / "other")
    assert got == {
        "pairs": 5,
        "baseline_correct": 1,
        "other_correct": 4,
        "only_other": 3,
        "only_baseline": 0,
        "p_value": pytest.approx(0.25),
    }


def test_report_compares_judge_runs_one_pass_against_the_swap_aggregate(tmp_path):
    """Two real judge runs on the same KV pair (slot letters; letters by content with the
    content-free calibration): ``ragfix report A B --json`` writes one row per run whose figures
    are each run's own one-pass verdict (the letter argmax, resp. the calibrated one), swap
    aggregate and calibrated logit verdict, the second tested against the first, and the file
    renders as a benchmark table."""
    from typer.testing import CliRunner

    from ragfix.cli.app import app
    from ragfix.eval.judge_run import run_judge
    from ragfix.eval.results import load_result, result_tables
    from ragfix.tables import markdown_tables

    data = data_file("litm_kv_retrieval_140_keys.jsonl.gz")
    plain, fixed = tmp_path / "slot", tmp_path / "content"
    run_judge(data, plain, records="7:8", device="cpu")
    run_judge(data, fixed, records="7:8", labels="content", calibrate="content-free", device="cpu")
    out = tmp_path / "judges.json"
    res = CliRunner().invoke(app, ["report", str(plain), str(fixed), "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = {r[0]: r for r in load_result(out)["rows"]}
    for name, source, agreement in (
        ("slot", "logit", "logit_original"),
        ("content", "contextual", "contextual_original"),
    ):
        s = next(
            iter(json.loads((tmp_path / name / "summary.json").read_text())["judges"].values())
        )
        m = s[source]
        row = rows[name]
        assert row[1:4] == ["smollm2", "vanilla", "verdict"] and row[6] == "1"
        assert row[7] == f"{m['position_consistency']:.3f} ({m['consistent_pairs']}/1)"
        assert row[10] == f"{s['agreement'][agreement]['accuracy']:.3f}"
        assert row[12] == f"{s['agreement']['swap_aggregated']['accuracy']:.3f}"
        assert row[13] == f"{s['agreement']['logit_calibrated']['accuracy']:.3f}"
        assert row[14] == f"{s['seconds_per_pair']:.2f}"
    assert rows["content"][4:6] == ["content", "content-free"]
    # the one-pass verdicts tested against the first run's (one pair: p = 1 whatever the counts)
    right = {
        name: next(
            iter(json.loads((tmp_path / name / "summary.json").read_text())["judges"].values())
        )["agreement"][agreement]["accuracy"]
        == 1.0
        for name, agreement in (("slot", "logit_original"), ("content", "contextual_original"))
    }
    b, c = int(right["content"] and not right["slot"]), int(right["slot"] and not right["content"])
    assert rows["slot"][15] == "baseline"
    assert rows["content"][15] == f"1 (+{b} / -{c})"
    # and set against the first run's one-pass verdict and letter probabilities, by hand
    [slot], [content] = (
        [json.loads(x) for x in (tmp_path / n / "judgments.jsonl").read_text().splitlines()]
        for n in ("slot", "content")
    )

    def argmax(o: dict, f: str) -> str:
        return "A" if o[f + "_a"] > o[f + "_b"] else "B" if o[f + "_b"] > o[f + "_a"] else "tie"

    same = int(argmax(slot["original"], "p") == argmax(content["original"], "q"))
    gap = max(abs(slot[o]["p_a"] - content[o]["p_a"]) for o in ("original", "swapped"))
    assert rows["slot"][16] == "baseline"
    assert rows["content"][16] == f"{same}/1, {gap:.3f}"
    [table] = result_tables(load_result(out), "benchmark")
    assert table.title.startswith("Judge corrections")
    # rendered, every line of the table has as many columns as its header
    rendered = [x for x in markdown_tables([table]).splitlines() if x.startswith("|")]
    assert len(rendered) == 4  # header, rule, two runs
    assert len({len(re.findall(r"(?<!\\)\|", x)) for x in rendered}) == 1
