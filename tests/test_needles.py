"""Questions from a user's own Markdown folder, no labels: needles planted in its chunks and
questions a model writes about them, through the real pipeline (the real MiniLM embedder, FAISS,
a tiny seeded model with SmolLM2's tokenizer answering), with the folder never written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_records
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.connectors.corpus import build_corpus, embedder, read_questions
from ragfix.connectors.questions import WRITTEN_QUESTIONS, WRITTEN_REPORT
from ragfix.connectors.synthetic import (
    DROP_REASONS,
    NeedleError,
    NeedleSettings,
    QuestionsFrom,
    insert_sentence,
    parse_written,
    write_questions,
)
from ragfix.errors import ConfigError, ConfigMismatchError
from ragfix.eval.compare import compare_runs, comparison_tables
from ragfix.eval.pipeline import run_pipeline_sweep
from ragfix.types import Generation

DOCS = {
    "rivers.md": (
        "# Rivers\n\nThe Danube flows through ten countries before it reaches the Black Sea. "
        "Its delta is a wetland where pelicans and herons nest in spring. Barges carry grain "
        "and timber along its middle course, and several capitals stand on its banks.\n\n"
        "The Rhine rises in the Alps and ends in the North Sea. Castles line the gorge between "
        "Bingen and Koblenz, where the river bends sharply around the Lorelei rock."
    ),
    "bread.md": (
        "# Bread\n\nSourdough is leavened by a culture of wild yeast and lactic acid bacteria. "
        "Bakers feed the starter with flour and water every day to keep it active. A long, cool "
        "fermentation gives the crumb its open structure and its slightly sour taste.\n\n"
        "Rye bread is dense and dark, and it keeps fresh for a week. In the north of Europe it "
        "is often baked with seeds, and eaten with butter and smoked fish."
    ),
    "notes/trains.md": (
        "# Trains\n\nThe first public railway to use steam locomotives opened in 1825. Within "
        "twenty years, lines linked most large towns, and timetables forced cities to agree on a "
        "common time. Night trains later carried mail and sleeping passengers across borders.\n\n"
        "High-speed lines need gentle curves and long tunnels. Their trains draw power from "
        "overhead wires and can run at three hundred kilometres an hour."
    ),
    "bees.md": (
        "# Bees\n\nA honey bee colony has one queen, a few hundred drones and thousands of "
        "workers. Workers dance to tell their sisters where flowers are: the angle of the dance "
        "points the way relative to the sun, and its length gives the distance.\n\n"
        "In winter the bees cluster around the queen and shiver to keep warm. They live on the "
        "honey they stored during the summer months."
    ),
    "tea.md": (
        "# Tea\n\nTea bushes grow on the steep hills of the Black Sea coast, where the rain "
        "falls all year. The leaves are picked by hand, withered, rolled and dried."
    ),
    "glass.md": (
        "# Glass\n\nGlass is made by melting sand with soda and lime. Glassblowers gather the "
        "molten glass on a long pipe and blow it into a bubble."
    ),
    "maps.md": (
        "# Maps\n\nA map projection flattens the curved surface of the Earth. Every projection "
        "distorts something: areas, angles, distances or directions."
    ),
}

runner = CliRunner()


@pytest.fixture
def folder(tmp_path):
    """A tiny Markdown folder of the user's (a subfolder, a hidden file of their own)."""
    d = tmp_path / "my-docs"
    for name, text in DOCS.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    (d / ".keep").write_text("")
    return d


def _listing(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _content(node):
    from llama_index.core.schema import MetadataMode

    return node.get_content(metadata_mode=MetadataMode.NONE)


def test_needles_are_planted_once_each_in_the_cache_index(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGFIX_CACHE", str(tmp_path / "cache"))
    before = _listing(folder)
    plain = build_corpus(folder)
    cor = build_corpus(folder, needles=NeedleSettings(count=3, seed=1))
    assert _listing(folder) == before  # the user's folder is never written
    for c in (plain, cor):
        assert c.rebuilt and c.where.is_relative_to(tmp_path / "cache" / "indexes")
    assert cor.where != plain.where and cor.where.parent == plain.where.parent
    assert len(cor.needles) == 3 and len({n.key for n in cor.needles}) == 3
    texts = {n.node_id: _content(n) for n in cor.nodes}
    for n in cor.needles:
        holding = [i for i, t in texts.items() if n.sentence in t]
        assert holding == [n.node_id]  # exactly once among the indexed chunks: the gold chunk
        assert sum(t.count(n.value) for t in texts.values()) == 1
        assert n.key not in " ".join(DOCS.values()).lower()
        assert n.question == f"What is the secret code of the {n.key}?"
    # each needle chunk keeps the size class: no more embedder tokens than the largest chunk
    tok = embedder()._model.tokenizer
    size = {i: len(tok(t, add_special_tokens=False)["input_ids"]) for i, t in texts.items()}
    plain_sizes = [
        len(tok(_content(n), add_special_tokens=False)["input_ids"]) for n in plain.nodes
    ]
    assert all(max(plain_sizes) / 2 <= size[n.node_id] <= max(plain_sizes) for n in cor.needles)
    # the other chunks are the plain index's
    plain_texts = {n.node_id: _content(n) for n in plain.nodes}
    gold = {n.node_id for n in cor.needles}
    assert {i: t for i, t in texts.items() if i not in gold} == {
        i: t for i, t in plain_texts.items() if i not in gold
    }
    # the same seed plants the same needles (the index is loaded, not rebuilt); another seed not
    again = build_corpus(folder, needles=NeedleSettings(count=3, seed=1))
    assert not again.rebuilt and again.needles == cor.needles
    other = build_corpus(folder, needles=NeedleSettings(count=3, seed=2))
    assert [n.key for n in other.needles] != [n.key for n in cor.needles]
    with pytest.raises(NeedleError, match="30 needles need as many chunks"):
        build_corpus(folder, needles=NeedleSettings(count=30))
    assert _listing(folder) == before


def test_insert_sentence_at_a_boundary_within_the_budget():
    words = len  # one "token" per character keeps the arithmetic visible
    text = "One two. Three four. Five six."
    assert insert_sentence(text, "X.", 0, 99, words) == "X. One two. Three four. Five six."
    assert insert_sentence(text, "X.", 2, 99, words) == "One two. Three four. X. Five six."
    assert insert_sentence(text, "X.", 3, 99, words) == "One two. Three four. Five six. X."
    # over budget: words go from the far end of the longer side
    assert insert_sentence(text, "X.", 1, 20, words) == "One two. X. Three"
    with pytest.raises(ValueError, match="boundary 4 of 4"):
        insert_sentence(text, "X.", 4, 99, words)


def test_needle_sweep_records_natural_rank_and_refuses_other_needles(folder, tmp_path, tiny_dir):
    out = tmp_path / "run"
    before = _listing(folder)
    kw = dict(strategies=["none"], top_k=3, positions="0,2", device="cpu", model=tiny_dir)
    summary = run_pipeline_sweep(folder, None, out, needles=NeedleSettings(count=2), **kw)
    assert _listing(folder) == before
    recs = run_records(out)
    assert len(recs) == 2 * 2 and summary["question_source"] == "needles"
    config = json.loads((out / "config.json").read_text())
    assert config["needles"] == {"count": 2, "seed": 0} and config["questions"] is None
    assert config["embedder"] == "all-minilm-l6-v2" and config["chunk_size"] == 64
    cor = build_corpus(folder, needles=NeedleSettings(count=2))
    assert not cor.rebuilt and str(cor.where) == summary["index"]
    # the natural rank, computed here from the embeddings alone (cosine, as FAISS inner product
    # over normalised vectors), among the corpus's chunks and the question's own needle: the
    # other needle's chunk is never retrieved with it, nor in the prompt
    from llama_index.core.schema import MetadataMode

    emb = embedder()
    chunks = np.array(
        [emb.get_text_embedding(n.get_content(metadata_mode=MetadataMode.EMBED)) for n in cor.nodes]
    )
    ids = [n.node_id for n in cor.nodes]
    for needle in cor.needles:
        q = np.array(emb.get_query_embedding(needle.question))
        others = {n.node_id for n in cor.needles} - {needle.node_id}
        order = [ids[i] for i in np.argsort(-(chunks @ q)) if ids[i] not in others]
        rank = order.index(needle.node_id)
        mine = [r for r in recs if r["question"] == needle.question]
        other_sentences = [n.sentence for n in cor.needles if n is not needle]
        assert not any(t in json.dumps(r["prompt"]) for r in mine for t in other_sentences)
        assert len(mine) == 2 and {r["gold_answers"][0] for r in mine} == {needle.value}
        expected = rank if rank < 3 else None
        assert {r["extra"]["natural_rank"] for r in mine} == {expected}
        assert all(r["extra"]["gold_added"] == (expected is None) for r in mine)
    # a rerun asks the same needles: every cell done, nothing computed
    text = (out / "results.jsonl").read_text()
    run_pipeline_sweep(folder, None, out, needles=NeedleSettings(count=2), **kw)
    assert (out / "results.jsonl").read_text() == text
    # another count or seed is another run: refused before anything is indexed or loaded
    with pytest.raises(ConfigMismatchError, match=r"needles\.count: 2 there, 3 now"):
        run_pipeline_sweep(folder, None, out, needles=NeedleSettings(count=3), **kw)
    with pytest.raises(ConfigMismatchError, match=r"needles\.seed: 0 there, 5 now"):
        run_pipeline_sweep(folder, None, out, needles=NeedleSettings(count=2, seed=5), **kw)
    with pytest.raises(ConfigMismatchError, match=r"chunk_size: 64 there, 48 now"):
        run_pipeline_sweep(folder, None, out, needles=NeedleSettings(count=2), chunk_size=48, **kw)
    with pytest.raises(ConfigError, match="one source of questions.*--questions and --needles"):
        run_pipeline_sweep(folder, folder / "q.jsonl", out, needles=NeedleSettings(count=2), **kw)


class _Scripted:
    """Answers each prompt with the next of the given replies (the filter's mechanism)."""

    def __init__(self, replies):
        self.replies = iter(replies)
        self.prompts = []

    def generate(self, prompts, **kw):
        self.prompts += prompts
        return [
            Generation(
                text=next(self.replies), prompt_tokens=1, new_tokens=1, prefill_tokens=1, seconds=0
            )
            for _ in prompts
        ]


#: what the scripted writer replies about each document's chunk, and why the filter drops it
WRITTEN = {
    "rivers.md": (" How many countries does the Danube cross?\nAnswer: ten countries", None),
    "bread.md": (" What leavens sourdough?\nAnswer: wild yeast", None),
    "bees.md": (" How many queens does a colony have?\nAnswer: dolphins", "answer_not_in_chunk"),
    "tea.md": (" Where do tea bushes grow?\nAnswer: the Black Sea", "answer_in_other_chunk"),
    "notes/trains.md": (
        " When did the first public railway to use steam locomotives open?\nAnswer: 1825",
        "quotes_chunk",
    ),
    "glass.md": (" What leavens sourdough?\nAnswer: soda and lime", "duplicate"),
    "maps.md": ("I cannot write a question about this.", "unparsed"),
}


def test_written_questions_are_filtered_and_every_drop_counted(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGFIX_CACHE", str(tmp_path / "cache"))
    cor = build_corpus(folder, chunk_size=256)  # one chunk a document
    doc = {n.node_id: n.metadata["doc_id"] for n in cor.nodes}
    assert sorted(doc.values()) == sorted(WRITTEN)
    settings = QuestionsFrom(model="scripted", chunks=len(cor.nodes), seed=3)
    probe = _Scripted(["x"] * len(cor.nodes))  # which chunk is asked when (the seeded draw)
    write_questions(probe, cor.nodes, settings)
    texts = {n.node_id: _content(n).strip() for n in cor.nodes}
    asked = [next(d for i, d in doc.items() if texts[i] in p.user) for p in probe.prompts]
    assert sorted(asked) == sorted(WRITTEN)
    assert asked.index("bread.md") < asked.index("glass.md")  # the first of two copies is kept
    made = write_questions(_Scripted([WRITTEN[d][0] for d in asked]), cor.nodes, settings)
    kept = [d for d in asked if WRITTEN[d][1] is None]
    assert [r["gold_text"] for r in made.records] == [
        next(texts[i] for i, x in doc.items() if x == d) for d in kept
    ]
    by_q = {r["question"]: r["answers"] for r in made.records}
    assert by_q["How many countries does the Danube cross?"] == ["ten countries"]
    assert made.asked == 7 and made.dropped == {
        **dict.fromkeys(DROP_REASONS, 1),
        "answer_in_question": 0,
    }
    assert made.report() == {"asked": 7, "kept": 2, "dropped": made.dropped}
    # a question that holds its own answer gives it away: dropped
    replies = {d: r for d, (r, _) in WRITTEN.items()}
    replies["rivers.md"] = " Which river crosses ten countries?\nAnswer: ten countries"
    made = write_questions(_Scripted([replies[d] for d in asked]), cor.nodes, settings)
    assert made.dropped["answer_in_question"] == 1
    assert [r["question"] for r in made.records] == ["What leavens sourdough?"]
    assert parse_written(" What?\nAnswer: yes") == ("What?", "yes")
    assert parse_written('Question: What?  Answer: "yes"\nmore') == ("What?", "yes")
    assert parse_written("no answer here") is None


def test_cli_needles_and_written_questions_through_the_pipeline(folder, tmp_path, tiny_dir):
    """``ragfix eval-pipeline --corpus DIR --needles 3``, then ``--questions-from`` a served model
    (the stand-in server, every reply the same pair: kept for the one chunk whose answer it is) with
    a tiny model answering; the question file is written to the run folder, reused by a rerun and
    readable with ``--questions``; the folder is never written."""
    from fake_openai import FakeOpenAI

    before = _listing(folder)
    out = tmp_path / "needles"
    small = ["--num-docs", "3", "--positions", "2", "--device", "cpu", "--model", tiny_dir]
    args = ["eval-pipeline", "--corpus", str(folder), "--needles", "3", "--out", str(out), *small]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "3 needles" in said and "retrieval-weighted" in said
    recs = run_records(out)
    assert len(recs) == 3 and {r["sample_id"] for r in recs} == {
        "needle-000",
        "needle-001",
        "needle-002",
    }
    assert all(r["question"].startswith("What is the secret code of the ") for r in recs)
    res = runner.invoke(app, [*args[:4], "4", *args[5:]])
    assert res.exit_code == 2 and "needles.count: 3 there, 4 now" in " ".join(res.output.split())
    res = runner.invoke(app, ["eval-pipeline", "--corpus", str(folder), "--out", str(out), *small])
    assert res.exit_code == 2 and "needs one source of questions" in res.output

    out = tmp_path / "written"
    pair = " How many countries does the Danube cross?\nAnswer: ten countries"
    with FakeOpenAI(pieces=[pair]) as server:
        args = ["eval-pipeline", "--corpus", str(folder), "--questions-from", "openai:fake"]
        args += ["--api-base", server.url, "--question-chunks", "20", "--chunk-size", "256"]
        args += ["--out", str(out), *small]
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
        seen = len(server.bodies)
        assert seen == 7  # 7 chunks (one a document), each asked once
        res = runner.invoke(app, args)  # a rerun reuses the folder's questions
        assert res.exit_code == 0, res.output
        assert len(server.bodies) == seen
    said = " ".join(res.output.split())
    assert "questions written by openai:fake: 1 of 7 kept" in said
    assert "answer_not_in_chunk 6" in said
    qs = read_questions(out / WRITTEN_QUESTIONS)
    assert [(q.question, q.answers) for q in qs] == [
        ("How many countries does the Danube cross?", ["ten countries"])
    ]
    assert qs[0].gold_text.startswith("# Rivers")
    report = json.loads((out / WRITTEN_REPORT).read_text())
    assert report["kept"] == 1 and report["dropped"]["answer_not_in_chunk"] == 6
    config = json.loads((out / "config.json").read_text())
    assert config["questions_from"] == {"model": "openai:fake", "chunks": 20, "seed": 0}
    assert config["chunk_size"] == 256 and "questions" in config["inputs"]
    (merit,) = [t for t in comparison_tables(compare_runs([out]), "merit") if "merit" in t.title]
    assert "written: questions written by openai:fake, 1 of 7 kept; dropped: unparsed 0, " in (
        " ".join(merit.lines)
    )
    assert {r["extra"]["natural_rank"] for r in run_records(out)} <= {0, 1, 2, None}
    assert _listing(folder) == before


def test_the_bundled_nq_sample_reads_as_a_corpus_of_its_passages():
    """The second corpus of the needle measurement: the Wikipedia passages of ``nq-sample``."""
    import gzip
    from pathlib import Path

    from ragfix.connectors.corpus import load_documents, resolve_demo

    path = resolve_demo(Path("nq-sample"), "corpus")
    with gzip.open(path, "rt") as f:
        ctxs = [c for line in f for c in json.loads(line)["ctxs"]]
    docs = load_documents(path)
    first = {}
    for c in ctxs:
        first.setdefault(c["id"], c)
    assert [d.id_ for d in docs] == list(first)  # each passage once, in file order
    assert [(d.metadata["title"], d.text) for d in docs] == [
        (c["title"], c["text"]) for c in first.values()
    ]
    assert resolve_demo(Path("nq-sample"), "questions") == Path("nq-sample")


def test_runs_of_other_needles_or_embedders_are_not_paired():
    from ragfix.eval.compare import config_differences

    base = {"run": "pipeline", "corpus": "/a/docs", "num_docs": 3, "needles": None}
    needles = {**base, "needles": {"count": 2, "seed": 0}}
    assert config_differences(needles, {**base, "needles": {"count": 2, "seed": 1}}) == [
        "needles {'count': 2, 'seed': 0} vs {'count': 2, 'seed': 1}"
    ]
    assert config_differences(base, needles)[0].startswith("needles none vs")
    # a run made before the embedder was recorded used the embedded default
    assert config_differences(base, {**base, "embedder": "all-minilm-l6-v2"}) == []
    assert config_differences(base, {**base, "embedder": "BAAI/bge-small-en"}) == [
        "embedder none vs BAAI/bge-small-en"
    ]


def _twice(tmp_path, names=("rivers.md", "bread.md")):
    """A corpus folder of the documents ``names`` whose every file has a copy (``copies/NAME``;
    for the second, ``NAME-copy.md`` with a trailing newline more), and the copies in words."""
    d = tmp_path / "twice"
    (d / "copies").mkdir(parents=True)
    for name in names:
        (d / name).write_text(DOCS[name])
    (d / "copies" / names[0]).write_text(DOCS[names[0]])
    made = [f"{names[0]} is a copy of copies/{names[0]}"]
    if len(names) > 1:
        stem = names[1].removesuffix(".md")
        (d / f"{stem}-copy.md").write_text(DOCS[names[1]] + "\n")  # white space aside
        made.insert(0, f"{names[1]} is a copy of {stem}-copy.md")
    return d, ", ".join(made)


def test_a_corpus_of_copies_says_which_files_are_copies_when_no_question_is_kept(tmp_path):
    """Issue 45: every file of the corpus has a copy, so the answer of every written question (a
    served model's, the one pair its chunk answers) is in the copy's chunk too and the filter keeps
    none; ``ragfix eval-pipeline --questions-from`` fails in one line that names the copies (which
    files are copies of which)."""
    from fake_openai import FakeOpenAI

    d, made = _twice(tmp_path, ("rivers.md",))
    pair = " How many countries does the Danube cross?\nAnswer: ten countries"
    out = tmp_path / "run"
    with FakeOpenAI(pieces=[pair]) as server:
        args = ["eval-pipeline", "--corpus", str(d), "--questions-from", "openai:fake"]
        args += ["--api-base", server.url, "--chunk-size", "256", "--out", str(out)]
        res = runner.invoke(app, [*args, "--num-docs", "2", "--positions", "0", "--device", "cpu"])
        assert len(server.bodies) == 2  # the two chunks, each asked once
    assert res.exit_code == 2, res.output
    [line] = [x for x in res.output.splitlines() if x.startswith("error: ")]
    assert line == (
        f"error: {out / WRITTEN_QUESTIONS}: no written question passed the filter (unparsed 0, "
        "answer_not_in_chunk 0, answer_in_other_chunk 2, answer_in_question 0, quotes_chunk 0, "
        f"duplicate 0; 1 file(s) of {d} are copies of others, and an answer in one is in its "
        f"copy too (answer_in_other_chunk): {made}; remove the copies)"
    )


def test_the_copies_of_a_corpus_are_warned_and_kept_with_its_index(tmp_path, monkeypatch):
    """Building the index warns, in one line, which documents are copies of which; the index's
    manifest keeps them (a load reads them there, silently); an index built before manifests
    kept them has them found again from the documents, and written into its manifest."""
    import warnings

    monkeypatch.setenv("RAGFIX_CACHE", str(tmp_path / "cache"))
    d, made = _twice(tmp_path)
    with pytest.warns(UserWarning) as caught:
        cor = build_corpus(d, chunk_size=256)
    assert cor.rebuilt and [str(w.message) for w in caught] == [
        f"{d}: 2 document(s) are copies of others (an answer in one is in its copy too): {made}"
    ]
    assert cor.copies == {"bread.md": "bread-copy.md", "rivers.md": "copies/rivers.md"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = build_corpus(d, chunk_size=256)
    assert not loaded.rebuilt and loaded.copies == cor.copies
    manifest = cor.where / "manifest.json"
    kept = json.loads(manifest.read_text())
    del kept["copies"]
    manifest.write_text(json.dumps(kept))
    with pytest.warns(UserWarning, match=made):
        again = build_corpus(d, chunk_size=256)
    assert not again.rebuilt and again.copies == cor.copies
    assert json.loads(manifest.read_text())["copies"] == cor.copies
