"""Cells keep what their model read, and ``ragfix report --html`` shows it: the prompt of every
sweep, pipeline and judge cell (or why it is not there), in one self-contained page, opened in a
real headless Chromium (the Debian package; ``.ci/run`` installs it and sets
``RAGFIX_REQUIRE_BROWSER``, so the browser test fails there instead of skipping)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import BUNDLED, data_file, run_records
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.connectors.litm import load_samples
from ragfix.errors import ConfigMismatchError
from ragfix.eval import run_judge, run_sweep
from ragfix.eval.compare import compare_loaded, load_runs
from ragfix.eval.html_report import load_judge_run, render_report
from ragfix.judge.judge import pair_prompts
from ragfix.tasks import task_prompt
from ragfix.types import JudgePair

NQ = BUNDLED / "nq_10docs_sample.jsonl.gz"
REBUILT = "rebuilt from nq_10docs_sample.jsonl.gz, fingerprint checked"
runner = CliRunner()


def _payload(html: str) -> dict:
    """The cell payload of a page (the JSON of its ``<script id="cells">``)."""
    m = re.search(r'<script type="application/json" id="cells">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def _text(payload: dict, segs) -> str:
    return "".join(payload["strings"][i] for i, _ in segs)


@pytest.fixture
def model_dir(tiny_dir):
    """The session's tiny seeded model with SmolLM2's tokenizer (``conftest.tiny_dir``): the
    prompts are the same text for any model; its answers cost a millisecond a token."""
    return Path(tiny_dir)


@pytest.fixture(scope="module")
def kept_run(tmp_path_factory, tiny_dir):
    """A sweep that kept its prompts: the tiny model on two samples of the bundled NQ sample,
    three documents, the gold one at every position."""
    out = tmp_path_factory.mktemp("kept") / "kept"
    common = dict(model=tiny_dir, num_docs=3, limit=2, workers=1, device="cpu")
    run_sweep(NQ, out, references=False, **common)
    return out


def test_sweep_cells_keep_the_prompt_their_model_read(kept_run):
    samples = {s.id: s for s in load_samples(NQ, 3, 2)}
    records = run_records(kept_run)
    assert len(records) == 6
    for r in records:
        s = samples[r["sample_id"]]
        tp = task_prompt(s, s.passages_with_gold_at(r["position"]))
        p = r["prompt"]
        assert p["text"] == tp.user and [tuple(x) for x in p["passages"]] == list(tp.passages)
        start, end = p["passages"][p["gold"]]
        assert p["gold"] == r["position"] and s.gold.text in p["text"][start:end]
        assert r["question"] == s.question and r["gold_answers"] == s.answers
    assert json.loads((kept_run / "config.json").read_text())["log_prompts"] is True


def test_prompts_left_out_keep_the_cells_and_are_never_mixed_with_kept_ones(tmp_path, model_dir):
    kept, bare = tmp_path / "kept", tmp_path / "bare"
    common = dict(model=str(model_dir), num_docs=2, limit=1, workers=1, device="cpu")
    run_sweep(NQ, kept, **common)
    run_sweep(NQ, bare, log_prompts=False, **common)
    a, b = run_records(kept), run_records(bare)
    assert [r["cell_id"] for r in a] == [r["cell_id"] for r in b]  # the same cells
    assert all(r["prompt"] is None and r["question"] and r["gold_answers"] for r in b)
    assert [r["answer"] for r in a] == [r["answer"] for r in b]
    with pytest.raises(ConfigMismatchError, match="log_prompts: false there, true now"):
        run_sweep(NQ, bare, **common)
    with pytest.raises(ConfigMismatchError, match="log_prompts: true there, false now"):
        run_sweep(NQ, kept, log_prompts=False, **common)
    assert run_sweep(NQ, bare, log_prompts=False, **common)["cells"] == 2  # resumed as it was


def test_a_folder_from_before_prompts_resumes_without_them_and_still_reports(tmp_path, model_dir):
    old = tmp_path / "old"
    common = dict(model=str(model_dir), num_docs=2, limit=1, workers=1, device="cpu")
    run_sweep(NQ, old, **common)
    config = json.loads((old / "config.json").read_text())
    del config["log_prompts"]
    (old / "config.json").write_text(json.dumps(config))
    lines = []
    for r in run_records(old):
        for k in ("prompt", "question", "gold_answers"):
            del r[k]
        lines.append(json.dumps(r) + "\n")
    (old / "results.jsonl").write_text("".join(lines))
    with pytest.raises(ConfigMismatchError, match="log_prompts: false there, true now"):
        run_sweep(NQ, old, **common)
    assert run_sweep(NQ, old, log_prompts=False, **common)["cells"] == 2
    runs = load_runs([old])
    page = render_report(runs, compare_loaded(runs), [])
    rows = _payload(page)["groups"][0]["rows"]
    assert len(rows) == 2 and all(r["q"] and r["gold"] for r in rows)  # from the data file
    assert {c["rebuilt"] for r in rows for c in r["cells"]} == {REBUILT}


def _old_folder(run: Path, to: Path, **config) -> Path:
    """A copy of ``run`` as a folder from before records kept prompts: no ``prompt`` in its
    records, no ``log_prompts`` in its ``config.json``; ``config`` overrides settings there."""
    shutil.copytree(run, to)
    stored = json.loads((to / "config.json").read_text())
    del stored["log_prompts"]
    (to / "config.json").write_text(json.dumps({**stored, **config}))
    records = [{k: v for k, v in r.items() if k != "prompt"} for r in run_records(to)]
    (to / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return to


def _cells(folder: Path) -> tuple[dict, dict[str, dict], str]:
    """The page of ``folder``: its payload, its cells by cell id, and the page."""
    runs = load_runs([folder])
    page = render_report(runs, compare_loaded(runs), [])
    payload = _payload(page)
    rows = payload["groups"][0]["rows"]
    ids = {(r["sample_id"], r["position"]): r["cell_id"] for r in run_records(folder)}
    cells = {ids[(row["key"], row["pos"])]: c for row in rows for c in row["cells"]}
    return payload, cells, page


def test_a_sweep_from_before_prompts_shows_the_prompts_its_sweep_stores(kept_run, tmp_path):
    """A run with its prompts, and the same folder without them: the page of the old folder
    rebuilds, for every cell, the very prompt the run stored (text, passages, gold passage,
    assistant prefix), labelled as rebuilt."""
    old = _old_folder(kept_run, tmp_path / "old")
    payload, cells, page = _cells(old)
    stored = {r["cell_id"]: r["prompt"] for r in run_records(kept_run)}
    assert set(cells) == set(stored) and len(cells) == 6
    for cid, cell in cells.items():
        p = stored[cid]
        assert cell["rebuilt"] == REBUILT and "missing" not in cell
        assert _text(payload, cell["prompt"]) == p["text"]
        assert cell["prefix"] == p["assistant_prefix"]
        start, end = p["passages"][p["gold"]]
        [gold] = [payload["strings"][i] for i, kind in cell["prompt"] if kind == 2]
        assert gold == p["text"][start:end]
        assert sum(kind > 0 for _, kind in cell["prompt"]) == len(p["passages"])
    assert f"<td>{REBUILT}</td>" in page  # the runs table
    assert not any("rebuilt" in c for c in _cells(kept_run)[1].values())  # stored: unlabelled


def test_an_old_sweep_s_prompts_are_rebuilt_only_from_what_it_read(tmp_path, model_dir):
    """Not rebuilt, with the reason in one line (each cell, the runs table, the notes): a
    changed or removed data file, and a backend that rearranges the passages before reading
    (attention-sort: what the model read needs the model); a run made with --no-log-prompts
    keeps its own message."""
    data = tmp_path / "nq.jsonl.gz"
    shutil.copy(NQ, data)
    common = dict(model=str(model_dir), num_docs=2, limit=2, workers=1, device="cpu")
    run_sweep(data, tmp_path / "run", **common)
    old = _old_folder(tmp_path / "run", tmp_path / "old")
    assert {c.get("rebuilt") for c in _cells(old)[1].values()} == {
        "rebuilt from nq.jsonl.gz, fingerprint checked"
    }

    sorted_ = _old_folder(tmp_path / "run", tmp_path / "sorted", backend="attention-sort")
    rearranged = (
        "prompt not stored; this backend rearranges the passages before reading, so it cannot "
        "be rebuilt without the model"
    )
    _, cells, page = _cells(sorted_)
    assert {c.get("missing") for c in cells.values()} == {rearranged}
    assert not any("prompt" in c for c in cells.values())
    assert f"sorted: {rearranged}" in page

    with gzip.open(data, "rt") as f:
        lines = f.readlines()
    with gzip.open(data, "wt") as f:
        f.writelines(lines[:-1])  # the run's records are all still there, but the file changed
    changed = (
        "prompt not stored: the run was made before ragfix kept prompts, and cannot be "
        f"rebuilt: the data file {data} has changed since the run (fingerprint check)"
    )
    _, cells, page = _cells(old)
    assert {c.get("missing") for c in cells.values()} == {changed}
    assert page.count(f"old: {changed}") == 1  # the notes line
    data.unlink()
    _, cells, _ = _cells(old)
    assert {c["missing"] for c in cells.values()} == {
        "prompt not stored: the run was made before ragfix kept prompts, and cannot be "
        f"rebuilt: {data} is not there any more"
    }

    shutil.copy(NQ, data)
    run_sweep(data, tmp_path / "bare", log_prompts=False, **common)
    _, cells, _ = _cells(tmp_path / "bare")
    assert {c["missing"] for c in cells.values()} == {
        "prompt not stored: the run was made with --no-log-prompts"
    }


def test_the_page_escapes_every_text(tmp_path, model_dir):
    """A prompt, an answer and a folder name full of markup reach the page as text: the payload
    cannot close its script element and the tables show the name escaped."""
    from ragfix.eval.sweep_summary import write_report

    run = tmp_path / "run<b>&amp"
    common = dict(model=str(model_dir), num_docs=2, limit=1, workers=1, device="cpu")
    run_sweep(NQ, run, **common)
    hostile = "</script><script>alert(1)</script><b>bold</b> & &amp;"
    records = run_records(run)
    for r in records:
        r["answer"] = hostile
        r["prompt"]["text"] = hostile + r["prompt"]["text"]
        r["prompt"]["passages"] = [
            [a + len(hostile), b + len(hostile)] for a, b in r["prompt"]["passages"]
        ]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(run, records)
    runs = load_runs([run])
    page = render_report(runs, compare_loaded(runs), [], title="<i>t</i>")
    assert "<script>alert(1)" not in page and "<b>bold" not in page and "<i>t</i>" not in page
    assert "run&lt;b&gt;&amp;amp" in page and "&lt;i&gt;t&lt;/i&gt;" in page
    payload = _payload(page)
    cells = [c for row in payload["groups"][0]["rows"] for c in row["cells"]]
    assert {c["answer"] for c in cells} == {hostile}
    assert all(_text(payload, c["prompt"]).startswith(hostile) for c in cells)


def test_pipeline_cells_keep_the_text_sent_with_the_gold_chunk(tmp_path, model_dir):
    from ragfix.connectors.corpus import DEMO_CORPUS, DEMO_QUESTIONS
    from ragfix.eval.pipeline import run_pipeline_sweep

    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "questions.jsonl"
    corpus.write_text("".join(DEMO_CORPUS.read_text().splitlines(keepends=True)[:8]))
    questions.write_text(DEMO_QUESTIONS.read_text().splitlines(keepends=True)[0])
    out = tmp_path / "pipe"
    run_pipeline_sweep(
        corpus,
        questions,
        out,
        ["none"],
        top_k=3,
        positions="0,2",
        model=str(model_dir),
        device="cpu",
    )
    records = run_records(out)
    q = json.loads(questions.read_text())
    assert len(records) == 2
    for r in records:
        p = r["prompt"]
        assert hashlib.sha1(p["text"].encode()).hexdigest() == r["extra"]["prompt_sha1"]
        assert len(p["passages"]) == 3 and p["gold"] == r["prompt_position"]
        start, end = p["passages"][p["gold"]]
        assert r["question"] == q["question"] and r["gold_answers"] == q["answers"]
        assert p["text"][start:end].strip() and q["question"] in p["text"]
    runs = load_runs([out])
    group = _payload(render_report(runs, compare_loaded(runs), []))["groups"][0]
    assert group["x_axis"] == "retrieval rank" and group["positions"] == [0, 2]
    _, cells, _ = _cells(_old_folder(out, tmp_path / "old"))  # only a SHA-1: never rebuilt
    assert {c["missing"] for c in cells.values()} == {
        "prompt not stored: the run was made before ragfix kept prompts"
    }


def test_a_judge_run_shows_both_orders_rebuilt_from_its_pair_file(tmp_path, model_dir):
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"question": "What is 2 + 2?", "answer_a": "4 <b>", "answer_b": "5", "label": 1},
        {"question": "Capital of France?", "answer_a": "Rome", "answer_b": "Paris", "label": 2},
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "judge"
    run_judge(pairs, out, model=str(model_dir), device="cpu")
    judged = load_judge_run(out)
    assert judged.missing == "" and len(judged.records) == 2
    payload = _payload(render_report([], None, [judged]))
    [group] = payload["groups"]
    assert group["kind"] == "judge" and group["columns"] == ["judge"]
    row = next(r for r in group["rows"] if r["q"] == "What is 2 + 2?")
    [cell] = row["cells"]
    pair = JudgePair(pair_id=row["key"], question="What is 2 + 2?", answer_a="4 <b>", answer_b="5")
    first, second = pair_prompts(pair)
    assert [_text(payload, o["prompt"]) for o in cell["orders"]] == [first.user, second.user]
    record = next(r for r in judged.records if r["pair_id"] == row["key"])
    assert [o["reply"] for o in cell["orders"]] == [
        record["original"]["raw"],
        record["swapped"]["raw"],
    ]
    page = tmp_path / "judge.html"
    result = runner.invoke(app, ["report", str(out), "--html", str(page)])
    assert result.exit_code == 0 and "as judge: position bias" in " ".join(result.output.split())
    assert _payload(page.read_text()) == payload
    result = runner.invoke(app, ["report", str(out), "--json", str(tmp_path / "c.json")])
    assert result.exit_code == 2 and "--json writes a comparison of sweeps" in result.output
    pairs.write_text(pairs.read_text().replace('"5"', '"six"'))
    assert "has changed since the run" in load_judge_run(out).missing


def _chromium() -> str:
    """The system Chromium; missing, the test fails where the browser is required (CI) and is
    skipped elsewhere."""
    path = os.environ.get("RAGFIX_CHROMIUM") or shutil.which("chromium")
    if path:
        return path
    if os.environ.get("RAGFIX_REQUIRE_BROWSER"):
        pytest.fail("no chromium (apt-get install -y chromium): the browser test must run here")
    pytest.skip("no chromium here (apt-get install -y chromium)")


def test_the_page_in_a_real_browser_opens_a_cell_at_the_worst_position(
    kept_run, tmp_path, model_dir
):
    """Two runs of the same cells side by side (one with its prompts, one without), the page
    opened in headless Chromium: the cell at the baseline's worst position shows the prompt the
    model read with the gold passage highlighted, its answer and the gold answers, as the
    record has them; a filter keeps the rows it names; a screenshot is saved."""
    browser_path = _chromium()
    from playwright.sync_api import sync_playwright

    from ragfix.eval.sweep_summary import write_report

    # the tiny model's answers are never right: the run with its cells marked right but one
    # sample's at position 1, so that position is the worst, and one of its rows right
    marked = tmp_path / "marked"
    shutil.copytree(kept_run, marked)
    records = run_records(marked)
    wrong = records[0]["sample_id"]
    for r in records:
        r["correct"] = (r["sample_id"], r["position"]) != (wrong, 1)
    (marked / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(marked, records)
    bare = tmp_path / "bare"
    common = dict(model=str(model_dir), num_docs=3, limit=2, workers=1, device="cpu")
    run_sweep(NQ, bare, log_prompts=False, **common)
    page_file = tmp_path / "report.html"
    result = runner.invoke(
        app,
        [
            "report",
            str(marked),
            str(bare),
            "--out",
            str(tmp_path / "c.png"),
            "--html",
            str(page_file),
        ],
    )
    assert result.exit_code == 0, result.output
    worst = json.loads((marked / "summary.json").read_text())["curves"]["vanilla"]["worst_position"]
    assert worst == 1
    records = {(r["sample_id"], r["position"]): r for r in run_records(marked)}
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.route(
            "**/*",
            lambda route: (
                route.abort() if not route.request.url.startswith("file:") else route.continue_()
            ),
        )  # nothing may be fetched
        page.goto(page_file.as_uri())
        assert page.locator(".positions button.current").get_attribute("data-pos") == str(worst)
        assert page.locator(".positions button.worst").get_attribute("data-pos") == str(worst)
        row = page.locator(f'details.row[data-pos="{worst}"]').first
        key = row.get_attribute("data-key")
        row.locator("summary").click()
        rec = records[(key, worst)]
        cell = row.locator('.cell[data-col="marked:vanilla"]')
        assert cell.locator("pre.answer").text_content() == (rec["answer"] or "(empty)")
        assert cell.locator("pre.prompt").text_content() == rec["prompt"]["text"]
        start, end = rec["prompt"]["passages"][rec["prompt"]["gold"]]
        assert cell.locator("mark.gold").text_content() == rec["prompt"]["text"][start:end]
        assert cell.locator(".gold-answers").text_content() == " | ".join(rec["gold_answers"])
        other = row.locator('.cell[data-col="bare:vanilla"]')
        assert "--no-log-prompts" in other.locator(".missing").text_content()
        row.scroll_into_view_if_needed()
        shot = page.screenshot(path=str(tmp_path / "report.png"))
        page.select_option("#relation", "wrong")
        shown = page.locator("details.row")
        assert shown.count() == 1  # of the two rows at the worst position
        assert all(
            "wrong" in (shown.nth(i).locator(".badge").first.get_attribute("class") or "")
            for i in range(shown.count())
        )
        browser.close()
    assert errors == []
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "report.png").stat().st_size > 10_000


def test_an_answer_style_judge_page_in_a_real_browser_shows_each_answers_likelihood(
    tmp_path, model_dir
):
    """A judge run in the ``answer`` style (no reply generated) on KV pairs with an unsupported
    wrong answer, its page opened in headless Chromium: each order of an opened pair says no
    reply was generated and shows both slots' log-likelihoods as its record has them."""
    browser_path = _chromium()
    from playwright.sync_api import expect, sync_playwright

    out = tmp_path / "judge"
    data = data_file("litm_kv_retrieval_140_keys.jsonl.gz")
    run_judge(data, out, records="3:5", style="answer", kv_wrong="unsupported",
              model=str(model_dir), device="cpu")  # fmt: skip
    page_file = tmp_path / "judge.html"
    result = runner.invoke(app, ["report", str(out), "--html", str(page_file)])
    assert result.exit_code == 0, result.output
    rec = json.loads((out / "judgments.jsonl").read_text().splitlines()[0])
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_file.as_uri())
        row = page.locator(f'details.row[data-key="{rec["pair_id"]}"]')
        row.locator("summary").click()
        orders = row.locator(".order")
        expect(orders).to_have_count(2)  # waits for the opened row's orders to be drawn
        for k, name in enumerate(("original", "swapped")):
            order = orders.nth(k)
            assert order.locator("pre.answer").text_content() == (
                "(none generated: each answer scored as the reply)"
            )
            shown = order.locator(".facts span").all_text_contents()
            assert f"log-likelihood of A's answer: {rec[name]['ll_a']:.3f}" in shown
            assert f"log-likelihood of B's answer: {rec[name]['ll_b']:.3f}" in shown
        browser.close()
    assert errors == []
