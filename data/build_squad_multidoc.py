"""Build ``squad_dev_multidoc.jsonl.gz`` from the developers' derived SQuAD file.

Input: ``derived_squad_dev_same_article.jsonl.gz`` (SQuAD v1.1 dev questions, each with its gold
paragraph and up to 20 other paragraphs of the same article without an answer string; described
in data/README.md). Output: the questions that have all 20 distractors (so any ``--num-docs`` up to
21 reads every record), split by article and shuffled, tune block first:

* tune: the articles at sorted index 0, 3, 6, ... (12 of the file's 36), 800 questions;
* test: the other 24 articles, 600 questions.

Records ``0:800`` are the tune range and ``800:1400`` the test range; each carries
``split`` (``tune`` or ``test``). The shuffle is ``random.Random(0)`` over the questions sorted by
``squad_id``, so a contiguous record range is a random sample of its split's questions.

The test split's questions are also written as a pipeline question file,
``squad_dev_multidoc_test_questions.jsonl`` beside the output (``id`` = the SQuAD id,
``question``, ``answers``, ``gold_doc_id`` = the gold paragraph's id among the output's ``ctxs``,
which ``ragfix eval-pipeline --corpus`` reads as its documents).

Usage: ``python data/build_squad_multidoc.py SOURCE.jsonl.gz data/squad_dev_multidoc.jsonl.gz``
"""

import gzip
import json
import random
import sys
from pathlib import Path

SIZES = {"tune": 800, "test": 600}


def main(source: str, target: str) -> None:
    with gzip.open(source, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    full = sorted((r for r in records if len(r["ctxs"]) == 21), key=lambda r: r["squad_id"])
    articles = sorted({r["article"] for r in full})
    tune_articles = set(articles[0::3])
    out = []
    for split, keep in (("tune", True), ("test", False)):
        block = [r for r in full if (r["article"] in tune_articles) == keep]
        random.Random(0).shuffle(block)
        out += [{**r, "split": split} for r in block[: SIZES[split]]]
    with gzip.GzipFile(target, "wb", mtime=0) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out).encode())
    questions = [
        {
            "id": r["squad_id"],
            "question": r["question"],
            "answers": r["answers"],
            "gold_doc_id": r["ctxs"][0]["id"],
        }
        for r in out
        if r["split"] == "test"
    ]
    path = Path(target).with_name("squad_dev_multidoc_test_questions.jsonl")
    path.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in questions))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
