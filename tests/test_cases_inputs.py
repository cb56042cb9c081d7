"""Issue 13, reading inputs and parsing verdicts: each failing case of ``tests/cases`` (cases
11, 13, 20, 21), the ``--num-docs`` larger than the file's passages mistake, and non-JSONL input,
asserted on the case's own file through the real readers, the real sweep store and report, and
the CLI."""

from __future__ import annotations

import gzip
import json
import re
import warnings
from pathlib import Path

import pytest
from conftest import case_file, data_file
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.connectors.corpus import load_documents, load_questions
from ragfix.connectors.jsonl import SkipCounter, read_jsonl
from ragfix.connectors.litm import load_kv, load_qa, load_samples
from ragfix.connectors.pairwise import load_mtbench, load_pairs, load_swap_judgments
from ragfix.errors import ConfigError, DataError
from ragfix.eval.sweep import SweepConfig, open_store, parse_positions, plan_cells
from ragfix.eval.sweep_summary import write_report
from ragfix.judge import parse_verdict
from ragfix.tasks import score_answer
from ragfix.types import SweepRecord

runner = CliRunner()


def _only_lines(src: Path, keep: set[int], dst: Path) -> Path:
    """``src`` with every line not in ``keep`` blanked (line numbers stay those of ``src``)."""
    lines = src.read_text(encoding="utf-8").split("\n")
    dst.write_text("\n".join(x if n in keep else "" for n, x in enumerate(lines, 1)))
    return dst


# ------------------------------------------------------------------ case 11: validated records

NQ_ERRORS = {  # line -> (field, problem) for 11_litm_nq_malformed.jsonl (see 11_expected.json)
    2: ("ctxs", "no passage has isgold = true"),
    3: ("ctxs", "2 passages have isgold = true (ctxs[0], ctxs[1])"),
    4: ("ctxs[2].title", "missing"),
    5: ("answers", "expected list, got the string 'Mary Shelley'"),
    6: (None, "malformed JSON"),
    8: ("ctxs[0].isgold", "expected true or false, got the string 'true'"),
    9: ("answers", "empty"),
}
KV_ERRORS = {  # line -> (field, problem) for 11_litm_kv_malformed.jsonl
    2: ("ordered_kv_records", "the gold pair [key, value] is not among the pairs"),
    3: (
        "ordered_kv_records[2]",
        "duplicate key '7f3c1a52-aaaa-4b1e-9c1d-000000000001' (also ordered_kv_records[0])",
    ),
    4: ("ordered_kv_records", "need at least 2 [key, value] pairs, got 1"),
    5: ("ordered_kv_records[0]", "expected a [key, value] pair, got an object"),
    6: ("ordered_kv_records[0]", "expected a [key, value] pair, got a list"),
}


def test_case11_expected_file_lists_these_lines():
    """Case 11: the tests below cover every line the case's expected file describes."""
    expected = json.loads(case_file("11_expected.json").read_text())["expected_per_line"]
    assert {int(k) for k, v in expected["nq"].items() if v.startswith("error")} == set(NQ_ERRORS)
    assert {int(k) for k, v in expected["kv"].items() if v.startswith("error")} == set(KV_ERRORS)


@pytest.mark.parametrize("line", sorted(NQ_ERRORS))
def test_case11_nq_line_is_refused_naming_file_line_field(line, tmp_path):
    """Case 11 (QA): each malformed record is one ``file:line: field: problem`` error; blank line
    7 is skipped and later line numbers still match the file."""
    field, problem = NQ_ERRORS[line]
    p = _only_lines(case_file("11_litm_nq_malformed.jsonl"), {1, line}, tmp_path / "nq.jsonl")
    with pytest.raises(DataError) as e:
        load_qa(p, 3)
    assert (e.value.line, e.value.field) == (line, field)
    assert str(e.value).startswith(f"{p}:{line}: {field + ': ' if field else ''}{problem}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("line", sorted(KV_ERRORS))
def test_case11_kv_line_is_refused_naming_file_line_field(line, tmp_path):
    """Case 11 (KV): wrong gold pair, duplicate key, one pair only, pairs that are not
    ``[key, value]``."""
    field, problem = KV_ERRORS[line]
    p = _only_lines(case_file("11_litm_kv_malformed.jsonl"), {1, line}, tmp_path / "kv.jsonl")
    with pytest.raises(DataError) as e:
        load_kv(p, 2)
    assert (e.value.line, e.value.field) == (line, field)
    assert str(e.value) == f"{p}:{line}: {field}: {problem}"


def test_case11_whole_files_stop_at_the_first_bad_line_or_skip_and_count():
    """Case 11: the case files as given stop at line 2; with skip_invalid only line 1 is kept
    and every other record is counted (7 QA, 5 KV); the string "true" never makes a gold."""
    nq, kv = case_file("11_litm_nq_malformed.jsonl"), case_file("11_litm_kv_malformed.jsonl")
    with pytest.raises(DataError, match=r"11_litm_nq_malformed\.jsonl:2: ctxs: no passage"):
        load_samples(nq, 3)
    with pytest.raises(DataError, match=r"11_litm_kv_malformed\.jsonl:2: ordered_kv_records"):
        load_samples(kv, 3)
    skipped = SkipCounter()
    [s] = load_samples(nq, 3, skip_invalid=True, skipped=skipped)
    assert s.source.endswith(":1") and s.gold.title == "Frankenstein" and skipped.count == 7
    assert [d.title for d in s.distractors] == ["Gothic fiction", "Percy Bysshe Shelley"]
    skipped = SkipCounter()
    [k] = load_samples(kv, 3, skip_invalid=True, skipped=skipped)
    assert k.source.endswith(":1") and skipped.count == 5
    assert k.answers == ["bb3ba2a5-dddd-4e4b-8f50-000000000022"]


def test_case11_gold_position_out_of_range_is_named():
    """Case 11 (gold_positions): position 3 of 3 documents is an error naming it (valid 0..2),
    never appended at the end."""
    spec = json.loads(case_file("11_expected.json").read_text())["gold_positions"]
    asked = ",".join(map(str, spec["positions_requested"]))
    with pytest.raises(ConfigError, match=r"3 is out of range 0\.\.2"):
        parse_positions(asked, spec["num_docs"])
    [s] = load_samples(case_file("11_litm_nq_malformed.jsonl"), 3, skip_invalid=True)
    with pytest.raises(ValueError, match="out of range"):
        s.passages_with_gold_at(3)


def test_case11_cli_is_one_line_with_exit_code_2(tmp_path):
    """Case 11: ``ragfix eval`` on the malformed file: one line naming file, line and field."""
    res = runner.invoke(
        app,
        ["eval", str(case_file("11_litm_nq_malformed.jsonl")), "--num-docs", "3"]
        + ["--out", str(tmp_path / "o")],
    )
    assert res.exit_code == 2
    assert "11_litm_nq_malformed.jsonl:2: ctxs: no passage has isgold = true" in res.output
    assert "Traceback" not in res.output


# ------------------------------------------------------------------ case 20: BOM and CRLF


def test_case20_bom_and_crlf_kv_read_like_plain_files():
    """Case 20: a UTF-8 byte order mark or CRLF line ends change nothing: both records are
    read, none is skipped, and the ids equal those of the CRLF file."""
    bom, crlf = case_file("20_bom_kv.jsonl"), case_file("20_crlf_kv.jsonl")
    assert bom.read_bytes()[:3] == b"\xef\xbb\xbf" and b"\r\n" in crlf.read_bytes()
    skipped = SkipCounter()
    a = load_samples(bom, 4, skip_invalid=True, skipped=skipped)
    b = load_samples(crlf, 4)
    assert skipped.count == 0 and len(a) == 2 == len(b)
    assert [s.id for s in a] == [s.id for s in b] == ["7f1b1ef21076", "bebe6de125c9"]
    assert a[0].question == "06e82a01-2b5c-4cd1-a7ca-430e92ac3d42"
    assert not any("\r" in s.answers[0] or "\ufeff" in s.question for s in a + b)


def test_case20_bom_in_gzip_and_in_pairs(tmp_path):
    """Case 20: the same in a gzip file, and in the judge's pair reader."""
    gz = tmp_path / "bom.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(case_file("20_bom_kv.jsonl").read_bytes().replace(b"\n", b"\r\n"))
    assert [s.id for s in load_kv(gz, 4)] == ["7f1b1ef21076", "bebe6de125c9"]
    pairs = load_pairs(case_file("20_bom_pairs.jsonl"))
    assert [(p.pair_id, p.label) for p in pairs] == [("p1", "A"), ("p2", "B")]
    assert pairs[0].question.startswith("What is the boiling point")


def test_case20_bom_and_crlf_in_corpus_and_questions(tmp_path):
    """Case 20: corpus documents (``.txt`` and a JSONL corpus) and pipeline questions written
    with a byte order mark and CRLF read as their text."""
    from llama_index.core.schema import TextNode

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "lighthouse.txt").write_bytes(b"\xef\xbb\xbfThe roof is red.\r\nBuilt 1871.\r\n")
    [doc] = load_documents(folder)
    assert doc.text == "The roof is red.\nBuilt 1871.\n"
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"id": "d1", "title": "T", "text": "Built 1871."}\r\n')
    [doc] = load_documents(jsonl)
    assert (doc.id_, doc.text) == ("d1", "Built 1871.")
    questions = tmp_path / "q.jsonl"
    rec = {"question": "when was it built", "answers": ["1871"], "gold_doc_id": "d1"}
    questions.write_bytes(b"\xef\xbb\xbf" + json.dumps(rec).encode() + b"\r\n")
    node = TextNode(text="Built 1871.", id_="d1#0", metadata={"doc_id": "d1"})
    [q] = load_questions(questions, [node])
    assert (q.question, q.gold_node_id) == ("when was it built", "d1#0")


# ------------------------------------------------------------------ case 21: duplicate ids


def _store_and_report(out: Path, samples, answer_for) -> dict:
    """What :func:`ragfix.eval.run_sweep` does with the cells of ``samples`` at position 0:
    plan the cells, compute those not stored yet (here the answer ``answer_for(sample)``,
    scored by the task's scorer), append them to the run store, and report the stored record of
    every planned cell."""
    config = SweepConfig(data="21", task="qa", num_docs=1, model="scripted", backend="vanilla")
    cells = plan_cells(config, samples, [0])
    store = open_store(out)
    done = store.load()
    for c in [c for c in cells if c.cell_id not in done]:
        answer = answer_for(c.sample)
        rec = SweepRecord(
            cell_id=c.cell_id,
            sample_id=c.sample.id,
            position=0,
            prompt_position=0,
            num_docs=1,
            backend="vanilla",
            prompt_tokens=1,
            prefill_tokens=1,
            new_tokens=1,
            answer=answer,
            correct=score_answer(c.sample, answer),
            seconds=0.0,
        )
        store.append(rec.model_dump(mode="json"))
    records = open_store(out).load()
    return write_report(out, [records[c.cell_id] for c in cells if c.cell_id in records])


def test_case21_duplicate_records_are_four_cells_and_position_0_is_half(tmp_path):
    """Case 21: four records, three with the same question and gold passage (one with another
    answer). Each becomes its own sample and cell, with a warning naming the lines; a judge
    answering "copper" and "1902" scores .500 at position 0 (it was .250: the first record's
    wrong answer was stored once and counted three times)."""
    path = case_file("21_duplicate_records.jsonl")
    with pytest.warns(UserWarning, match="line 2 has the question and gold passage of line 1"):
        samples = load_qa(path, 1)
    assert len(samples) == 4 and len({s.id for s in samples}) == 4
    assert samples[1].id == samples[0].id + "#2" and samples[2].id == samples[0].id + "#3"
    assert samples[2].answers == ["copper"]

    def answer(sample):
        return "copper" if "lighthouse" in sample.question else "1902"

    summary = _store_and_report(tmp_path / "run", samples, answer)
    [pos0] = summary["curves"]["vanilla"]["positions"]
    assert (pos0["n"], pos0["correct"], pos0["accuracy"]) == (4, 2, 0.5)
    # the same file again: the same ids, so a rerun resumes every cell instead of adding any
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = load_qa(path, 1)
    assert [s.id for s in again] == [s.id for s in samples]
    assert _store_and_report(tmp_path / "run", again, answer)["cells"] == 4


def test_case21_duplicate_pair_ids_are_judged_and_counted_once_each(tmp_path):
    """Case 21 (judge pairs): a pair id given twice keeps two pairs, the later one ``#2``."""
    lines = case_file("20_bom_pairs.jsonl").read_text(encoding="utf-8-sig").splitlines()
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join([lines[0], lines[1], lines[0].replace("100 degrees", "212 F")]))
    with pytest.warns(UserWarning, match=r"line 3 has the pair id of line 1 \(now pair 'p1#2'\)"):
        pairs = load_pairs(p)
    assert [x.pair_id for x in pairs] == ["p1", "p2", "p1#2"]
    assert pairs[2].answer_a == "212 F Celsius."


def test_case21_ids_that_name_one_thing_are_refused_naming_both_lines(tmp_path):
    """Case 21: where two records cannot both hold (a model's answer to one question, one
    evaluator's verdict on one item, a corpus document id), the second is refused."""
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 81, "turns": ["Hi?"]}) + "\n")
    ans = {"question_id": 81, "model_id": "m1", "choices": [{"turns": ["Hello"]}]}
    a = tmp_path / "answers.jsonl"
    a.write_text("\n".join(json.dumps(x) for x in [ans, {**ans, "model_id": "m2"}, ans]))
    with pytest.raises(DataError, match=r"answers\.jsonl:3: question_id: duplicate answer of m1 "):
        load_mtbench(a, q, ("m1", "m2"))
    verdict = {"evaluator": "E", "subset": "S", "idx": 0, "label": 1}
    verdict |= {"winner_original_order": "1", "winner_swapped_order": "1"}
    s = tmp_path / "swap.jsonl"
    s.write_text(json.dumps(verdict) + "\n" + json.dumps(verdict) + "\n")
    with pytest.raises(DataError, match=r"swap\.jsonl:2: idx: duplicate verdict of E on S:0 "):
        load_swap_judgments(s)
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"id": "d1", "text": "a"}\n{"id": "d1", "text": "b"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2: id: duplicate document id 'd1' \(also"):
        load_documents(docs)


# ------------------------------------------------------------------ case 13: verdict strings

CASE13 = {  # id -> (format any, format mtbench, format llmbar), per the case's "expected"
    "v1": ("B", "B", "invalid"),
    "v2": ("B", "B", "invalid"),  # a final verdict after an earlier one: the last wins
    "v3": ("tie", "tie", "invalid"),
    "v4": ("A", "A", "invalid"),
    "v5": ("invalid", "invalid", "invalid"),  # "Tie." in words, not as a verdict
    "v6": ("invalid", "invalid", "invalid"),
    "v7": ("invalid", "invalid", "invalid"),  # a refusal
    "v8": ("invalid", "invalid", "invalid"),  # single brackets are not the format
    "v9": ("B", "B", "invalid"),  # letters are case-insensitive (documented)
    "v10": ("B", "invalid", "B"),  # LLMBar's "Output (b)"
    "v11": ("B", "B", "invalid"),  # the last-match rule (documented)
}


def _case13():
    path = case_file("13_judge_verdict_strings.jsonl")
    return [rec for _, rec in read_jsonl(path)]


@pytest.mark.parametrize("rec", _case13(), ids=lambda r: r["id"])
def test_case13_verdict_strings(rec):
    """Case 13: every line of the case file, under each verdict format; never "A" where the
    expected verdict is another."""
    any_, mtbench, llmbar = CASE13[rec["id"]]
    assert parse_verdict(rec["judgment"]) == any_
    assert parse_verdict(rec["judgment"], "mtbench") == mtbench
    assert parse_verdict(rec["judgment"], "llmbar") == llmbar
    if rec["expected"].startswith(("unparsed", "B", "tie")):
        assert parse_verdict(rec["judgment"]) != "A"


def test_case13_covers_every_line_and_ties_in_words():
    """Case 13: the table covers the whole file; "The verdict is a tie." is a tie (it was A); a
    quoted marker is the format, not a verdict, so the final one after it counts."""
    assert [r["id"] for r in _case13()] == list(CASE13)
    assert parse_verdict("The verdict is a tie.") == "tie"
    assert parse_verdict("The verdict is a clear win for B") == "invalid"
    assert parse_verdict('The format is "[[A]]" or "[[B]]". My verdict: [[B]]') == "B"
    with pytest.raises(ConfigError, match="unknown verdict format"):
        parse_verdict("[[A]]", "fastchat")


# ------------------------------------------------------------------ --num-docs beyond the file


def test_num_docs_beyond_the_records_passages_is_refused():
    """``--num-docs 30`` on a file of 20-passage records is refused naming the file, the line,
    the record's passage count and --num-docs (it padded each sample with 10 passages of other
    questions); with skip_invalid nothing is left, and the error says why; an explicit
    distractor pool draws the missing ones."""
    path = data_file("derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz")
    with pytest.raises(DataError) as e:
        load_samples(path, 30, limit=2)
    assert str(e.value) == (
        f"{path}:1: ctxs: --num-docs 30 needs 29 distractors but the record has 20 passages; "
        "use --num-docs 20 or less, or give --distractor-pool FILE to draw the missing "
        "distractors from"
    )
    with pytest.raises(DataError, match=r"no valid records \(200 skipped; first: .*:1: ctxs:"):
        load_samples(path, 30, skip_invalid=True, skipped=SkipCounter())
    [s] = load_samples(path, 30, limit=1, distractor_pool=data_file("litm_nq_open_oracle.jsonl.gz"))
    assert len(s.distractors) == 29
    assert s.distractors[:19] == load_samples(path, 20, limit=1)[0].distractors


def test_num_docs_beyond_the_records_passages_cli(tmp_path):
    """The new user's command of the issue fails with one line, exit code 2."""
    path = data_file("derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz")
    res = runner.invoke(
        app,
        ["eval", str(path), "--num-docs", "30", "--positions", "first,middle,last"]
        + ["--limit", "2", "--out", str(tmp_path / "o")],
    )
    assert res.exit_code == 2, res.output
    assert "gold_at_0.jsonl.gz:1: ctxs: --num-docs 30 needs 29 distractors" in res.output
    assert "the record has 20 passages" in res.output and "Traceback" not in res.output


# ------------------------------------------------------------------ input that is not JSONL


def test_json_array_and_csv_are_named_as_not_jsonl(tmp_path):
    """A JSON array file or a CSV is refused at line 1 (even with skip_invalid): "expected one
    JSON object per line", naming the fields the reader wants."""
    records = [rec for _, rec in read_jsonl(case_file("21_duplicate_records.jsonl"))]
    array = tmp_path / "qa.json"
    array.write_text(json.dumps(records, indent=1))
    qa_fields = "question, answers, ctxs[title, text, isgold]"
    with pytest.raises(DataError) as e:
        load_qa(array, 1, skip_invalid=True, skipped=SkipCounter())
    assert str(e.value) == (
        f"{array}:1: expected one JSON object per line (JSON Lines) with fields {qa_fields}; "
        "this line is a JSON array"
    )
    with pytest.raises(DataError, match=re.escape(f"{qa_fields} (QA) or ordered_kv_records")):
        load_samples(array, 1)
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answers\nwho wrote frankenstein,Mary Shelley\n")
    with pytest.raises(DataError, match=r"qa\.csv:1: expected one JSON object per line .* not a"):
        load_qa(csv, 1)
    pairs = tmp_path / "pairs.json"
    lines = case_file("20_bom_pairs.jsonl").read_text(encoding="utf-8-sig").splitlines()
    pairs.write_text("[" + ",".join(lines) + "]")
    with pytest.raises(DataError, match=r"pairs\.json:1: .* fields question, answer_a, answer_b"):
        load_pairs(pairs)
    with pytest.raises(DataError, match=r"fields question, answers, gold_text or gold_doc_id"):
        load_questions(csv, [])
