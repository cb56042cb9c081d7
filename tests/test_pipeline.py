"""The position sweep through the real LlamaIndex pipeline, on a handful of cells of real NQ
passages (bundled demo corpus) with the real SmolLM2."""

from __future__ import annotations

import json

import pytest

from ragfix.connectors.corpus import DEMO_CORPUS, DEMO_QUESTIONS
from ragfix.errors import ConfigError
from ragfix.eval.pipeline import run_pipeline_sweep
from ragfix.integrations.engine import candidates_with_gold_at
from ragfix.reorder import ProfileError


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """The first 12 passages of the bundled NQ demo corpus and two of their questions; the
    second question's gold passage is swapped for one that retrieval will not rank in the top 3
    (so the sweep must add it)."""
    d = tmp_path_factory.mktemp("nq")
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(DEMO_CORPUS.read_text().splitlines(keepends=True)[:12]))
    qs = [json.loads(x) for x in DEMO_QUESTIONS.read_text().splitlines()[:2]]
    qs[1]["gold_doc_id"] = qs[0]["gold_doc_id"]
    (d / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs))
    return corpus, d / "questions.jsonl"


def test_candidates_put_gold_at_each_rank():
    from llama_index.core.schema import NodeWithScore, TextNode

    res = [
        NodeWithScore(node=TextNode(text=t, id_=t), score=s)
        for t, s in zip("abcd", [4, 3, 2, 1], strict=True)
    ]
    gold = res[2]
    for r in range(4):
        c = candidates_with_gold_at(res, gold, r)
        assert [n.node.node_id for n in c].index("c") == r
        assert [n.node.node_id for n in c if n.node.node_id != "c"] == ["a", "b", "d"]
        assert [n.score for n in c] == [4, 3, 2, 1]
    outside = NodeWithScore(node=TextNode(text="g", id_="g"))
    assert [n.node.node_id for n in candidates_with_gold_at(res, outside, 1)] == list("agbc")


def test_sweep_through_the_pipeline(small_corpus, tmp_path, smol):
    corpus, questions = small_corpus
    out = tmp_path / "run"
    summary = run_pipeline_sweep(
        corpus=corpus,
        questions=questions,
        out=out,
        strategies=["none", "reverse"],
        top_k=3,
        positions="0,2",
        device="cpu",
    )
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * 2 * 2
    for r in recs:
        assert r["extra"]["llm_calls"] == 1 and not r["extra"]["context_cut"]
        expected = r["position"] if r["strategy"] == "none" else 2 - r["position"]
        assert r["prompt_position"] == expected
        assert r["num_docs"] == 3 and r["answer"]
        assert r["extra"]["framework"] == "llamaindex" and len(r["extra"]["prompt_sha1"]) == 40
    added = {r["sample_id"]: r["extra"]["gold_added"] for r in recs}
    assert added == {"nq-0200": False, "nq-0201": True}
    assert set(summary["curves"]) == {"vanilla/none", "vanilla/reverse"}
    assert summary["x_axis"] == "retrieval rank" and summary["gold_added"] == 1
    # retrieval-weighted: each question whose gold chunk the retriever ranked r (a swept rank)
    # contributes the curve's accuracy at r, computed here from the records
    ranks = {r["sample_id"]: r["extra"]["natural_rank"] for r in recs}
    for s in ("none", "reverse"):
        ok = {(r["sample_id"], r["position"]): r["correct"] for r in recs if r["strategy"] == s}
        hits = [sum(ok[q, k] for q in ranks) / 2 for k in ranks.values() if k in (0, 2)]
        got = summary["retrieval_weighted"].get(f"vanilla/{s}")
        assert got == (pytest.approx(sum(hits) / len(hits)) if hits else None)
    assert (out / "curve.png").stat().st_size > 0
    config = json.loads((out / "config.json").read_text())
    assert (config["retriever"], config["chunk_size"], config["framework"]) == (
        "faiss",
        64,
        "llamaindex",
    )
    assert "distractor_pool" not in config
    # a rerun finds every cell done and computes nothing
    before = (out / "results.jsonl").read_text()
    run_pipeline_sweep(
        corpus=corpus,
        questions=questions,
        out=out,
        strategies=["none", "reverse"],
        top_k=3,
        positions="0,2",
        device="cpu",
    )
    assert (out / "results.jsonl").read_text() == before
    # a profile measured with another number of documents is refused before any work
    with pytest.raises(ProfileError, match="for 3 documents, not 4"):
        run_pipeline_sweep(
            corpus=corpus,
            questions=questions,
            out=tmp_path / "other",
            strategies=["bias-profile"],
            top_k=4,
            profile=out / "summary.json",
        )


def test_same_cells_give_the_same_prompts_in_every_framework(
    small_corpus, tmp_path, tiny_qwen3_dir
):
    """One question, gold at ranks 0 and 2, lost-in-the-middle, through LlamaIndex, LangChain
    and Haystack: the model reads the same prompt (SHA-1) and answers the same in each cell; the
    framework is part of the run config and the cell ids. A mechanism: the tiny Qwen3, whose
    answer differs between the two cells (asserted)."""
    corpus, questions = small_corpus
    runs = {}
    for framework in ("llamaindex", "langchain", "haystack"):
        out = tmp_path / framework
        run_pipeline_sweep(
            corpus=corpus,
            questions=questions,
            out=out,
            strategies=["lost-in-the-middle"],
            top_k=3,
            positions="0,2",
            limit=1,
            model=tiny_qwen3_dir,
            device="cpu",
            framework=framework,
        )
        recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        assert {r["extra"]["framework"] for r in recs} == {framework}
        assert json.loads((out / "config.json").read_text())["framework"] == framework
        runs[framework] = {(r["sample_id"], r["position"]): r for r in recs}
    cells = sorted(runs["llamaindex"])
    assert len(cells) == 2
    for cell in cells:
        li, lc, hs = (runs[f][cell] for f in ("llamaindex", "langchain", "haystack"))
        assert (
            li["extra"]["prompt_sha1"] == lc["extra"]["prompt_sha1"] == hs["extra"]["prompt_sha1"]
        )
        assert li["answer"] == lc["answer"] == hs["answer"]
        assert li["prompt_position"] == lc["prompt_position"] == hs["prompt_position"]
        assert li["extra"]["order"] == lc["extra"]["order"] == hs["extra"]["order"]
        assert len({li["cell_id"], lc["cell_id"], hs["cell_id"]}) == 3
    assert [runs["haystack"][c]["prompt_position"] for c in cells] == [0, 1]  # ranks 0, 2
    assert len({runs["llamaindex"][c]["answer"] for c in cells}) == 2  # a cell's answer shows
    with pytest.raises(ConfigError, match="--framework: 'dspy' is not one of"):
        run_pipeline_sweep(
            corpus=corpus,
            questions=questions,
            out=tmp_path / "x",
            strategies=["none"],
            framework="dspy",
        )


def test_orders_through_the_pipeline_keep_every_vote_and_never_resume_onto_other_orders(
    small_corpus, tmp_path, tiny_qwen3_dir
):
    """``--orders``: each cell's LLM answers over orders of the chunks its postprocessor passed
    on (``passages_from``); every vote is the model's own answer to that order of the prompt the
    record keeps, and a folder is never resumed onto other orders. A mechanism: the tiny Qwen3
    (peaked attention), whose answer changes with the order of the chunks (asserted)."""
    from typer.testing import CliRunner

    from ragfix.backends import load_backend
    from ragfix.cli.app import app
    from ragfix.errors import ConfigMismatchError
    from ragfix.prompts import TaskPrompt, find_passages
    from ragfix.tasks import get_task, join_chunks

    corpus, questions = small_corpus
    out = tmp_path / "run"
    orders = {"orders": 3, "aggregate": "plurality"}
    kw = dict(corpus=corpus, questions=questions, strategies=["none"], top_k=3, limit=1)
    kw |= dict(model=tiny_qwen3_dir)
    run_pipeline_sweep(out=out, positions="0,2", device="cpu", orders=orders, **kw)
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    llm = load_backend("vanilla", model=tiny_qwen3_dir, device="cpu")
    for r in recs:
        stored = r["prompt"]
        chunks = [stored["text"][a:b] for a, b in stored["passages"]]
        user = get_task("qa").user_turn(r["question"], join_chunks(chunks))
        assert stored["text"] == llm.format_prompt(TaskPrompt(user=user))
        spans = tuple(find_passages(user, chunks))
        prompt = TaskPrompt(user=user, passages=spans, max_new_tokens=32, stop_at_newline=True)
        votes = r["extra"]["votes"]
        assert [v["order"] for v in votes] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
        singles = llm.generate([prompt.reordered(v["order"]) for v in votes], batch_size=1)
        assert [v["answer"] for v in votes] == [g.text for g in singles]
        assert len({g.text for g in singles}) > 1  # the order moves the answer: a vote of
        # another order in its place shows
        assert r["answer"] in [g.text for g in singles]
    config = json.loads((out / "config.json").read_text())
    assert config["backend_options"]["orders"]["orders"] == 3
    assert config["identity"]["orders"]["aggregate"] == "plurality"
    run_pipeline_sweep(out=out, positions="0,2", device="cpu", orders=orders, **kw)
    assert len((out / "results.jsonl").read_text().splitlines()) == 2  # every cell done
    with pytest.raises(ConfigMismatchError):
        run_pipeline_sweep(
            out=out, positions="0,2", device="cpu", orders={**orders, "orders": 2}, **kw
        )
    with pytest.raises(ConfigMismatchError):
        run_pipeline_sweep(out=out, positions="0,2", device="cpu", **kw)
    res = CliRunner().invoke(
        app, ["eval-pipeline", "--corpus", str(corpus), "--orders-aggregate", "plurality"]
    )
    assert res.exit_code != 0
    assert "--orders-aggregate is a setting of --orders K: give --orders too" in res.output
    # `ragfix tune orders` reads a pipeline run with its QA task's scorer (issue 55, item 6:
    # "unknown task 'qa-pipeline'"): each (orders, aggregate) row scores the vote it picks
    from ragfix.eval.orders_tune import tune_orders

    # the tiny model answers nothing right: the records' gold answers are made a vote the run did
    # not keep (the first record) and the one it kept (the second), so both score both ways
    recs.sort(key=lambda r: r["position"])
    first, second = recs
    other = next(v["answer"] for v in first["extra"]["votes"] if v["answer"] != first["answer"])
    first["gold_answers"], second["gold_answers"] = [other], [second["answer"]]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    table, details = tune_orders(out)
    qa = get_task("qa")
    assert details["positions"] == [r["position"] for r in recs] and details["samples"] == 1
    # the run's own setting picks the answer each record kept
    want = [float(qa.score(r["answer"], r["gold_answers"])) for r in recs]
    assert details["accuracy"]["orders=3 aggregate=plurality"] == want
    assert details["ceiling"] == [
        float(any(qa.score(v["answer"], r["gold_answers"]) for v in r["extra"]["votes"]))
        for r in recs
    ]
    assert want == [0.0, 1.0] and details["ceiling"] == [1.0, 1.0]


def test_natural_ranks_run_each_question_where_its_retriever_put_it_under_the_task(
    small_corpus, tmp_path, tiny_dir
):
    from ragfix.tasks import get_task

    corpus, questions = small_corpus
    kw = dict(corpus=corpus, questions=questions, strategies=["none", "reverse"], top_k=3)
    kw |= dict(model=tiny_dir)  # a mechanism: the tiny model answers wrong (as SmolLM2 did)
    out = tmp_path / "natural"
    summary = run_pipeline_sweep(
        out=out, positions="natural", device="cpu", task="qa-extractive", **kw
    )
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    # the question whose gold chunk the retriever missed is left out; the other runs once per
    # strategy, at its natural rank, in the task's prompt
    assert {r["sample_id"] for r in recs} == {"nq-0200"} and len(recs) == 2
    assert all(r["position"] == r["extra"]["natural_rank"] for r in recs)
    assert summary["ranks"] == "natural" and summary["gold_added"] == 1
    head = get_task("qa-extractive").instruction
    assert all(head in r["prompt"]["text"] for r in recs)
    for r in recs:  # one question: the end-to-end accuracy is its cell's
        assert summary["retrieval_weighted"][f"vanilla/{r['strategy']}"] == float(r["correct"])
    config = json.loads((out / "config.json").read_text())
    assert config["qa_task"] == "qa-extractive"
    assert config["qa_task_form"] == get_task("qa-extractive").fingerprint()
    # `ragfix report` says of how many questions asked the gold chunk was retrieved: the one
    # missed has no cell, and it read "1 of 1"
    from ragfix.eval.compare import compare_runs

    asked = sum(summary["natural_rank_counts"].values())
    assert asked == 2 and summary["natural_rank_counts"]["None"] == 1
    comparison = compare_runs([out])
    for m in comparison["runs"][0]["retrieval_weighted"].values():
        assert (m["retrieved"], m["questions"]) == (1, asked)
    # the CI gate reads a pipeline run's retrieval-weighted accuracy as its mean, and refuses
    # a paired difference over natural ranks (each rank holds other questions)
    from ragfix.eval.gate import gate_failures, parse_gates

    failed = gate_failures(comparison, parse_gates(["mean>=0.5"]))
    assert len(failed) == 2 and all("(retrieval-weighted) mean" in f for f in failed)
    assert all("[0.000, 1.000], 1 samples" in f for f in failed)  # one question: no interval
    with pytest.raises(ConfigError, match="natural-rank pipeline run"):
        gate_failures(comparison, parse_gates(["diff>=0"]))


def test_a_record_range_asks_only_its_questions_and_binds_the_folder(
    small_corpus, tmp_path, tiny_dir
):
    from typer.testing import CliRunner

    from ragfix.backends import load_backend
    from ragfix.cli.app import app
    from ragfix.connectors.synthetic import NeedleSettings
    from ragfix.errors import ConfigMismatchError, DataError

    corpus, questions = small_corpus
    tiny = load_backend("vanilla", model=tiny_dir, device="cpu")  # a mechanism: the tiny model
    out = tmp_path / "second"
    kw = dict(corpus=corpus, questions=questions, strategies=["none"], top_k=3, positions="0")
    run_pipeline_sweep(out=out, records="1:2", backend=tiny, **kw)
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    # record 1 is the file's second line: its question alone, at the one rank asked
    assert [r["sample_id"] for r in recs] == ["nq-0201"]
    assert recs[0]["extra"]["gold_added"]  # the question whose gold the retriever misses
    assert json.loads((out / "config.json").read_text())["records"] == "1:2"
    with pytest.raises(ConfigMismatchError, match="records"):
        run_pipeline_sweep(out=out, records="0:2", backend=tiny, **kw)
    with pytest.raises(DataError, match="--records 4:9 holds none of its 2 questions"):
        run_pipeline_sweep(out=tmp_path / "none", records="4:9", backend=tiny, **kw)
    with pytest.raises(ConfigError, match="--records picks questions of a file"):
        run_pipeline_sweep(
            corpus=corpus, questions=None, out=tmp_path / "n", strategies=["none"], top_k=3,
            needles=NeedleSettings(count=2), records="0:1", backend=tiny,
        )  # fmt: skip
    res = CliRunner().invoke(
        app, ["eval-pipeline", "--corpus", str(corpus), "--questions", str(questions),
              "--records", "5:2", "--out", str(tmp_path / "cli")],
    )  # fmt: skip
    assert res.exit_code == 2 and "--records '5:2': expected START:END" in res.output
    assert len(res.output.strip().splitlines()) == 1
