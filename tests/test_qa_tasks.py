"""Task forms for QA (extractive, demonstrations, closed-book, repetition) and the sweep's
reference points (closed-book, oracle), on the real SmolLM2 and the bundled SQuAD file."""

import json

import pytest
from conftest import data_file, run_records, tiny_folder
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.eval.compare import load_run
from ragfix.eval.sweep import CLOSED_BOOK, LEGACY_TASK_FORMS, ORACLE, REFERENCE_POSITION
from ragfix.metrics import wilson_interval
from ragfix.tasks import REPEAT_SEPARATOR, SQUAD_DEMONSTRATIONS, get_task
from ragfix.types import Passage

runner = CliRunner()
DOCS = [
    Passage(title="Rivers", text="The Rhine flows into the North Sea."),
    Passage(title="Cities", text="Paris is the capital of France.", is_gold=True),
    Passage(title="Mountains", text="Mont Blanc is in the Alps."),
]


def test_the_legacy_fingerprints_are_the_tasks_as_they_are():
    # a folder written before configurations recorded task_form stands for these: editing the
    # qa or kv prompt must change them (and so refuse those folders), never silently resume
    assert {n: get_task(n).fingerprint() for n in LEGACY_TASK_FORMS} == LEGACY_TASK_FORMS
    forms = {get_task(n).fingerprint() for n in ("qa", "qa-extractive", "qa-extractive-2shot")}
    assert len(forms) == 3


def test_the_extractive_forms_render_passages_demonstrations_and_closed_book():
    plain, shot = get_task("qa-extractive"), get_task("qa-extractive-2shot")
    p = shot.prompt("What is the capital of France?", DOCS)
    assert [p.user[a:b] for a, b in p.passages] == [
        f"Document [{i}](Title: {d.title}) {d.text}" for i, d in enumerate(DOCS, 1)
    ]
    # the demonstrations stand between the instruction and the context, answered
    head = p.user[: p.passages[0][0]]
    assert head.startswith(plain.instruction)
    for demo in SQUAD_DEMONSTRATIONS:
        assert f"Question: {demo.question}\nAnswer: {demo.answer}\n\n" in head
        assert all(d.text in head for d in demo.passages)
    assert p.user.endswith("Question: What is the capital of France?\nAnswer:")
    assert (
        p.user[p.passages[0][0] :]
        == plain.prompt("What is the capital of France?", DOCS).user[len(plain.instruction) + 2 :]
    )
    # no passages: the closed-book form, which knows it has none, the examples without theirs
    closed = shot.prompt("What is the capital of France?", [])
    assert closed.user == (
        "Answer the question with a short phrase.\n\n"
        "Question: What disease did Tesla catch?\nAnswer: cholera\n\n"
        "Question: Who is the commissioner of the NFL?\nAnswer: Roger Goodell\n\n"
        "Question: What is the capital of France?\nAnswer:"
    )
    assert plain.prompt("Why?", []).user == (
        "Answer the question with a short phrase.\n\nQuestion: Why?\nAnswer:"
    )
    assert closed.closed_book and closed.passages == ()
    assert get_task("qa").prompt("Who?", []).user == "Question: Who?\nAnswer:"
    assert not p.closed_book


def test_repetition_puts_every_passage_twice_with_its_spans():
    for mode in ("passages", "prompt"):
        task = get_task(f"qa-extractive:repeat-{mode}")
        once = get_task("qa-extractive").prompt("Which capital?", DOCS)
        p = task.prompt("Which capital?", DOCS)
        texts = [p.user[a:b] for a, b in p.passages]
        assert texts == [*once.passage_texts(), *once.passage_texts()]
        assert p.no_query.passage_texts() == once.no_query.passage_texts() * 2
        if mode == "prompt":  # the first copy without the answer cue: the cue read once
            first = once.user.removesuffix("\nAnswer:")
            assert p.user == first + REPEAT_SEPARATOR + once.user and p.user.count("Answer:") == 1
        else:
            context = "".join(get_task("qa-extractive").passage_texts(DOCS))
            assert context + REPEAT_SEPARATOR + context in p.user
            assert p.user.count("Question: Which capital?") == 1
        assert task.llama_index_template().count("{context_str}") == 2
        assert task.fingerprint() != get_task("qa-extractive").fingerprint()


@pytest.mark.parametrize("name", ["attention-sort", "calibrated-attention", "pine", "set-based"])
def test_a_closed_book_prompt_reads_as_the_model_does_under_every_passage_method(name, tmp_path):
    # the closed-book reference point of a passage method is the model without passages: each
    # method's answer, first-token log-probabilities and log-likelihood equal vanilla's, alone
    # and batched with a prompt that has passages
    from ragfix.backends import load_backend

    folder = str(tiny_folder(tmp_path / "tiny"))
    task = get_task("qa-extractive")
    closed = task.prompt("What is the capital of France?", [])
    other = task.prompt("What is the capital of France?", DOCS)
    vanilla = load_backend("vanilla", model=folder, device="cpu")
    method = load_backend(name, model=folder, device="cpu")
    want = vanilla.generate([closed], max_new_tokens=6, first_logprobs=True)[0]
    alone = method.generate([closed], max_new_tokens=6, first_logprobs=True)[0]
    batched = method.generate([other, closed], max_new_tokens=6, first_logprobs=True)[1]
    for got in (alone, batched):
        assert got.token_ids == want.token_ids
        assert (got.first_logprobs - want.first_logprobs).abs().max() < 1e-5
    ll = method.loglikelihood([(closed, " Paris")])[0]
    assert ll == pytest.approx(vanilla.loglikelihood([(closed, " Paris")])[0], abs=1e-4)


SQUAD = "squad_dev_multidoc.jsonl.gz"


def squad_record(folder, index: int):
    """Record ``index`` of the SQuAD file alone, as a one-record file: the sample the whole file
    gives for it (its distractors are its own ctxs), read without parsing the file's 1,400
    records."""
    import gzip
    from itertools import islice

    with gzip.open(data_file(SQUAD), "rt") as f:
        [line] = islice(f, index, index + 1)
    path = folder / f"squad-{index}.jsonl"
    path.write_text(line)
    return path


@pytest.fixture(scope="module")
def squad_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("squad") / "run"
    args = [
        "eval", str(data_file(SQUAD)), "--records", "0:2", "--num-docs", "2",
        "--positions", "0,1", "--task", "qa-extractive", "--device", "cpu", "--out", str(out),
    ]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return out, args, res.output


def test_a_qa_sweep_reports_closed_book_and_oracle_before_its_curve(squad_run):
    out, _, output = squad_run
    recs = run_records(out)
    refs = [r for r in recs if r["reference"]]
    assert sorted((r["reference"], r["num_docs"]) for r in refs) == sorted(
        [(CLOSED_BOOK, 0), (ORACLE, 1)] * 2
    )
    assert {r["position"] for r in refs} == {REFERENCE_POSITION}
    for r in refs:  # what the model read: no passage, or the gold passage alone
        gold = r["prompt"]["passages"]
        assert len(gold) == (r["reference"] == ORACLE)
        assert "Question: " in r["prompt"]["text"]
    summary = json.loads((out / "summary.json").read_text())
    curve = summary["curves"]["vanilla"]
    assert [p["n"] for p in curve["positions"]] == [2, 2] and summary["cells"] == 4
    for name in (CLOSED_BOOK, ORACLE):
        ok = sum(r["correct"] for r in refs if r["reference"] == name)
        low, high = wilson_interval(ok, 2)
        want = {"n": 2, "correct": ok, "accuracy": ok / 2, "low": low, "high": high}
        assert summary["references"]["vanilla"][name] == want
    assert summary["config"]["task"] == "qa-extractive"
    assert summary["config"]["task_form"] == get_task("qa-extractive").fingerprint()
    text = " ".join(output.split())
    assert text.index("closed-book") < text.index("prompt position")
    # a report reads the curve without the reference cells
    run = load_run(out)
    assert {pos for _, pos in run.curves["vanilla"]} == {0, 1}


def test_a_sweep_never_resumes_under_an_edited_task_and_resumes_an_older_folder(
    squad_run, tmp_path, tiny_dir
):
    out, args, _ = squad_run
    config = json.loads((out / "config.json").read_text())
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "results.jsonl").write_text((out / "results.jsonl").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "task_form": "0123456789abcdef"}))
    res = runner.invoke(app, [*args[:-1], str(edited)])
    assert res.exit_code != 0 and "task_form" in res.output
    # a qa folder written before task_form was recorded stands for today's qa prompt (the
    # resume's bookkeeping: on the tiny seeded model)
    old, more = tmp_path / "old", ["--task", "qa", "--no-references", "--records", "0:1"]
    more += ["--model", tiny_dir]
    res = runner.invoke(app, [*args[:-1], str(old), *more])
    assert res.exit_code == 0, res.output
    stored = json.loads((old / "config.json").read_text())
    assert stored.pop("task_form") == LEGACY_TASK_FORMS["qa"]
    (old / "config.json").write_text(json.dumps(stored))
    res = runner.invoke(app, [*args[:-1], str(old), *more])
    assert res.exit_code == 0 and "resuming: 2 of 2" in res.output, res.output


@pytest.mark.parametrize(
    "args",
    [
        ["--repeat", "prompt", "--orders", "2"],
        ["--task", "qa:repeat-passages", "--orders", "2"],  # a repeated task named outright
        ["--repeat", "passages", "--backend", "pine"],
        ["--repeat", "prompt", "--backend", "attention-sort"],
    ],
)
def test_repetition_with_a_method_that_reads_the_passages_is_refused(args, tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["eval", str(data_file(SQUAD)), *args, "--out", str(out)])
    assert res.exit_code == 2 and "would take the two copies for more passages" in res.output
    assert not out.exists()


def test_a_task_of_the_other_format_and_an_unknown_repetition_are_refused(tmp_path):
    squad = str(data_file(SQUAD))
    res = runner.invoke(app, ["eval", squad, "--task", "kv", "--out", str(tmp_path / "a")])
    assert res.exit_code == 2 and "--task kv reads kv records" in res.output
    assert "qa-extractive-2shot" in res.output
    res = runner.invoke(app, ["eval", squad, "--repeat", "twice", "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "unknown repetition 'twice'" in res.output
    assert not any(tmp_path.iterdir())


def test_the_flags_table_lists_reference_points_after_the_positions():
    from ragfix.eval.sweep_summary import flags_table

    spec = flags_table({"flags": {"degenerate_gold": {"10": 1, "2": 3, "oracle": 1}}})
    assert spec.rows == [["2", "3"], ["10", "1"], ["oracle", "1"]]


def test_the_html_report_of_a_run_with_reference_points_lists_its_positions_only(squad_run):
    import re

    from ragfix.eval.compare import compare_loaded, load_runs
    from ragfix.eval.html_report import render_report

    out, _, _ = squad_run
    runs = load_runs([out])
    comparison = compare_loaded(runs)
    page = render_report(runs, comparison, [])
    found = re.search(r'<script type="application/json" id="cells">(.*?)</script>', page, re.S)
    payload = json.loads(found.group(1))
    rows = payload["groups"][0]["rows"]
    assert sorted({r["pos"] for r in rows}) == [0, 1] and len(rows) == 4
    assert "reference points and the ceiling" in page


def test_bench_methods_measures_a_repeated_prompt_against_the_task_it_repeats(tiny_dir, tmp_path):
    # the rows' mechanism (which prompt each row reads, as the backend encodes it): a tiny model
    # with SmolLM2's tokenizer and chat template counts the same tokens
    from ragfix.backends import load_backend
    from ragfix.bench.methods import bench_methods
    from ragfix.connectors.litm import load_samples

    path = squad_record(tmp_path, 0)
    _, details = bench_methods(
        ["vanilla"], [2], limit=1, model=tiny_dir, device="cpu", data=path,
        task="qa-extractive", repeats=["prompt"],
    )  # fmt: skip
    plain = load_backend("vanilla", model=tiny_dir, device="cpu")
    once, twice = details["measurements"]
    assert (once["backend"], twice["backend"]) == ("vanilla", "vanilla --repeat prompt")
    assert details["task"] == "qa-extractive" and once["prefill_x"] == 1.0
    [sample] = load_samples(path, 2, limit=1)
    for row, name in ((once, "qa-extractive"), (twice, "qa-extractive:repeat-prompt")):
        prompt = get_task(name).prompt(sample.question, sample.passages_with_gold_at(0))
        assert row["prompt_tokens"] == [len(plain.encode(prompt))]
    assert twice["prompt_tokens"][0] > 1.9 * once["prompt_tokens"][0]


@pytest.mark.parametrize("mode", ["passages", "prompt"])
def test_a_repeated_prompt_is_answered_as_transformers_answers_the_text_built_by_hand(
    mode, tmp_path
):
    # the independent computation: the repeated user turn written out by hand, put in the chat
    # template by the tokenizer and decoded greedily by transformers' own generate
    import torch

    from ragfix.backends import load_backend

    folder = str(tiny_folder(tmp_path / "tiny"))
    backend = load_backend("vanilla", model=folder, device="cpu")
    once = get_task("qa-extractive").prompt("Which capital?", DOCS)
    context = "\n".join(once.passage_texts())
    head = once.user[: once.passages[0][0]]
    tail = once.user[once.passages[-1][1] :]
    if mode == "passages":
        text = head + context + "\n\n" + context + tail
    else:
        text = once.user.removesuffix("\nAnswer:") + "\n\n" + once.user
    ids = backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    want = backend.model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1] :]
    [got] = backend.generate(
        [get_task(f"qa-extractive:repeat-{mode}").prompt("Which capital?", DOCS)],
        max_new_tokens=5,
        stop_at_newline=False,
    )
    assert (
        got.prompt_tokens == ids.shape[1] and got.token_ids == want.tolist()[: len(got.token_ids)]
    )


def test_a_base_model_answers_a_repeated_prompt_in_the_completion_form(tmp_path):
    # Gemma 3 270M (base, no chat template) reads the task's completion form: the repeated turn
    # by hand, decoded greedily by transformers. With the answer cue in both copies it answers
    # the first cue's pattern (a blank line) and so nothing; with the cue once it answers.
    from ragfix.backends import load_backend
    from ragfix.connectors.litm import load_samples

    backend = load_backend("vanilla", model="gemma3-270m")
    sample = load_samples(squad_record(tmp_path, 800), 3, 1)[0]  # --records 800:801
    task = get_task("qa-extractive-2shot")
    once = task.prompt(sample.question, sample.passages_with_gold_at(2)).user

    def greedy(text: str) -> str:
        ids = backend.tokenizer(text, return_tensors="pt").input_ids
        out = backend.model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
        return backend.tokenizer.decode(out, skip_special_tokens=True)

    assert greedy(once + "\n\n" + once).startswith("\n")  # the cue twice: a blank answer
    want = greedy(once.removesuffix("\nAnswer:") + "\n\n" + once).split("\n")[0]
    repeated = get_task("qa-extractive-2shot:repeat-prompt")
    [got] = backend.generate([repeated.prompt(sample.question, sample.passages_with_gold_at(2))])
    assert want.strip() and got.text == want.strip(), (got.text, want)


def test_the_ceiling_is_the_worst_position_against_the_oracle_by_hand():
    from scipy.stats import binomtest

    from ragfix.eval.compare import _to_ceiling

    samples = [f"s{i}" for i in range(8)]
    oracle = dict.fromkeys(samples, True)
    cells = {(s, 0): s == "s0" for s in samples}  # right once: the worst position
    cells |= {(s, 1): True for s in samples} | {(s, 2): s != "s7" for s in samples}
    c = _to_ceiling(oracle, cells)
    raw = binomtest(0, 7, 0.5).pvalue  # exact McNemar: 7 cells right only under the oracle
    assert (c["worst_position"], c["positions"], c["n"]) == (0, 3, 8)
    assert (c["oracle_only"], c["position_only"]) == (7, 0)
    assert c["accuracy"] == 1 / 8 and c["oracle_accuracy"] == 1.0 and c["difference"] == -7 / 8
    assert c["p_raw"] == pytest.approx(raw) and c["p"] == pytest.approx(3 * raw)  # Bonferroni
    # paired on the samples both have; none in common: no ceiling
    assert _to_ceiling({"s0": False, "s1": True}, cells)["n"] == 2
    assert _to_ceiling({"other": True}, cells) is None
