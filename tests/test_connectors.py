import gzip
import json

import pytest
from conftest import data_file

from ragfix.bundled import bundled_path
from ragfix.connectors.corpus import CorpusError, load_documents
from ragfix.connectors.jsonl import SkipCounter
from ragfix.connectors.litm import detect_format, load_kv, load_qa, load_samples
from ragfix.errors import DataError, RagfixError


def test_derived_nq_file_counts_and_gold_placement():
    path = data_file("derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz")
    samples = load_qa(path, num_docs=10)
    assert len(samples) == 200
    s = samples[0]
    assert s.question == "who got the first nobel prize in physics"
    assert s.answers == ["Wilhelm Conrad Röntgen"]
    assert len(s.distractors) == 9 and not any(d.is_gold for d in s.distractors)
    for p in range(10):
        ctx = s.passages_with_gold_at(p)
        assert len(ctx) == 10 and ctx[p] == s.gold
        # same distractors, same order, whatever the position
        assert [c for c in ctx if not c.is_gold] == s.distractors
    with pytest.raises(ValueError, match="out of range"):
        s.passages_with_gold_at(10)


def test_same_question_same_distractors_across_gold_files():
    a = load_qa(data_file("derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz"), 20, limit=3)
    b = load_qa(data_file("derived_nq_20docs_bm25pool_gold_at_9.jsonl.gz"), 20, limit=3)
    assert [x.id for x in a] == [x.id for x in b]
    assert a[1].distractors == b[1].distractors


def test_oracle_file_draws_bm25_distractors_without_answers():
    samples = load_qa(data_file("litm_nq_open_oracle.jsonl.gz"), num_docs=5, limit=20)
    assert len(samples) == 20
    for s in samples:
        assert len(s.distractors) == 4
        for d in s.distractors:
            assert d.title != s.gold.title
            assert not any(a.lower() in d.text.lower() for a in s.answers)


def test_kv_reader_removes_gold_and_truncates():
    path = data_file("litm_kv_retrieval_75_keys.jsonl.gz")
    samples = load_kv(path, num_pairs=8, limit=500)
    assert len(samples) == 500
    s = samples[0]
    assert s.task == "kv" and len(s.distractors) == 7
    assert s.gold.title == s.question and s.answers == [s.gold.text]
    assert s.question not in [d.title for d in s.distractors]
    assert detect_format(path) == "kv"


def test_bundled_samples_load():
    assert len(load_samples(bundled_path("nq-sample"), 10)) == 60
    assert len(load_samples(bundled_path("kv-sample"), 16)) == 60


def _gold_only(title: str, text: str, question: str, answer: str) -> str:
    ctx = {"title": title, "text": text, "isgold": True}
    return json.dumps({"question": question, "answers": [answer], "ctxs": [ctx]})


def test_pool_distractors_in_bm25_order(tmp_path):
    # gold-only records: the other records' gold passages are the pool, ranked by BM25
    # (Lucene idf: a word in 2 of the 5 passages weighs 0.88, in 3 of them 0.54)
    lines = [
        _gold_only(
            "The Lord of the Rings",
            "An epic novel by J. R. R. Tolkien.",
            "who wrote the lord of the rings trilogy",
            "Tolkien",
        ),
        _gold_only("Films", "A film trilogy about rings and a dark lord.", "q2", "x2"),
        _gold_only("Sequels", "The trilogy concluded in 2003 with a third film.", "q3", "x3"),
        _gold_only("Paris", "Paris is the capital of France.", "q4", "x4"),
        _gold_only("Saturn", "Saturn has rings made of ice.", "q5", "x5"),
    ]
    p = _write(tmp_path, lines)
    s = load_qa(p, num_docs=5, limit=1)[0]
    # trilogy + rings + lord; rings + of (0.54 x 2) before trilogy alone (0.88); of alone
    assert [d.title for d in s.distractors] == ["Films", "Saturn", "Sequels", "Paris"]
    assert not any(d.is_gold for d in s.distractors)
    # a passage holding the answer is never a distractor
    lines[4] = _gold_only("Saturn", "Saturn has rings, Tolkien said.", "q5", "x5")
    s = load_qa(_write(tmp_path, lines), num_docs=4, limit=1)[0]
    assert [d.title for d in s.distractors][0] == "Films"
    assert sorted(d.title for d in s.distractors) == ["Films", "Paris", "Sequels"]


def _write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = json.dumps(
    {
        "question": "q1",
        "answers": ["a1"],
        "ctxs": [{"title": "T", "text": "a1 is here", "isgold": True}],
    }
)


def test_malformed_line_names_file_and_line(tmp_path):
    p = _write(tmp_path, [GOOD, "{not json", GOOD.replace("q1", "q2")])
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON"):
        load_qa(p, 1)
    skipped = SkipCounter()
    samples = load_qa(p, 1, skip_invalid=True, skipped=skipped)
    assert [s.question for s in samples] == ["q1", "q2"] and skipped.count == 1


def test_record_without_gold_or_answers(tmp_path):
    no_gold = json.dumps({"question": "q", "answers": ["a"], "ctxs": [{"title": "", "text": "x"}]})
    with pytest.raises(DataError, match=r"d\.jsonl:1: ctxs: no passage has isgold"):
        load_qa(_write(tmp_path, [no_gold]), 1)
    no_answers = json.dumps({"question": "q", "answers": [], "ctxs": []})
    with pytest.raises(DataError, match=r":1: answers: empty"):
        load_qa(_write(tmp_path, [no_answers]), 1)


def test_too_many_docs_is_refused(tmp_path):
    p = tmp_path / "two.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(GOOD + "\n" + GOOD.replace("q1", "q2").replace("a1 is here", "other") + "\n")
    with pytest.raises(DataError, match="needs 4 distractors"):
        load_qa(p, 5)
    # the real oracle record whose one-letter answer ("S") is in nearly every passage
    oracle = data_file("litm_nq_open_oracle.jsonl.gz")
    with pytest.raises(DataError, match=r"oracle\.jsonl\.gz:1841: ctxs: --num-docs 10 needs 9"):
        load_qa(oracle, 10)
    skipped = SkipCounter()
    samples = load_qa(oracle, 10, skip_invalid=True, skipped=skipped)
    assert skipped.count >= 1 and ":1841:" in skipped.examples[0]
    assert "atlantic ocean's shape" not in [s.question for s in samples]
    assert len(samples) == 2000 - skipped.count


def test_missing_file():
    with pytest.raises(DataError, match="file not found"):
        load_samples("/nonexistent/x.jsonl", 10)


def test_corpus_errors_are_user_errors(tmp_path):
    with pytest.raises(CorpusError, match="no such folder or file") as e:
        load_documents(tmp_path / "none")
    assert isinstance(e.value, RagfixError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no readable documents"):
        load_documents(tmp_path / "empty")


def test_a_symlinked_subfolder_is_read_and_every_file_left_out_is_named(tmp_path, monkeypatch):
    """Issue 45: a corpus folder whose subfolder is a symbolic link (to a folder elsewhere) has
    that subfolder's documents read, under the link's name, and in the corpus's fingerprint;
    links that would read a folder twice or loop are left out, and every entry left out is named
    with why in one warning line."""
    from ragfix.connectors.corpus import corpus_fingerprint

    monkeypatch.setenv("RAGFIX_CACHE", str(tmp_path / "cache"))
    outside = tmp_path / "shared-notes"
    (outside / "deep").mkdir(parents=True)
    (outside / "tides.md").write_text("The tide turns twice a day.")
    (outside / "deep" / "reefs.txt").write_text("Coral reefs grow slowly.")
    (outside / "deep" / "back").symlink_to(outside, target_is_directory=True)  # a loop
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.md").write_text("Alpha is the first letter.")
    (docs / "sub" / "c.md").write_text("Gamma is the third letter.")
    (docs / "notes").symlink_to(outside, target_is_directory=True)
    (docs / "repeat").symlink_to(outside, target_is_directory=True)  # the same folder again
    (docs / "inner").symlink_to(docs / "sub", target_is_directory=True)
    (docs / "sub" / "up").symlink_to(docs, target_is_directory=True)  # a loop to the corpus
    (docs / "gone.md").symlink_to(tmp_path / "missing.md")
    (docs / "table.csv").write_text("a,b\n1,2\n")
    (docs / "empty.md").write_text("  \n")
    (docs / ".hidden").mkdir()
    (docs / ".hidden" / "h.md").write_text("Hidden text.")
    skipped = SkipCounter()
    with pytest.warns(UserWarning) as caught:
        read = load_documents(docs, skipped)
    assert [d.id_ for d in read] == [
        "a.md",
        "notes/deep/reefs.txt",
        "notes/tides.md",
        "sub/c.md",
    ]
    assert read[1].text == "Coral reefs grow slowly."
    [warning] = [str(w.message) for w in caught if "left out" in str(w.message)]
    assert "\n" not in warning
    assert warning == (
        f"{docs}: 8 left out of the corpus: "
        ".hidden/ (hidden); "
        "gone.md (a broken symbolic link); "
        "inner/ (a symbolic link to sub/ inside the corpus, read there); "
        "notes/deep/back/ (a folder read already as notes/); "
        "repeat/ (a folder read already as notes/); "
        "sub/up/ (a symbolic link to a folder that holds the corpus: a loop); "
        "table.csv (not a .txt/.md/.pdf/.html/.htm file); "
        "empty.md (no text)"
    )
    assert skipped.count == 1 and "no text" in skipped.examples[0]
    before = corpus_fingerprint(docs)
    (outside / "tides.md").write_text("The tide turns twice a day, about.")
    assert corpus_fingerprint(docs) != before
