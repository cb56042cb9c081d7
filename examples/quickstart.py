"""Quick start: ragfix inside a LlamaIndex query engine, then the position curve of the same
documents. Offline, on the embedded models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2).

    python examples/quickstart.py

The first run embeds the bundled corpus (400 passages, 1-2 minutes on a CPU; kept on disk);
later runs take about a minute.
"""

import json
from pathlib import Path

from ragfix import RagFixLLM, RagFixPostprocessor, build_corpus, text_qa_template
from ragfix.backends import load_backend
from ragfix.bundled import DEMO_CORPUS
from ragfix.eval.pipeline import run_pipeline_sweep

DOCS = DEMO_CORPUS  # or your folder of .txt / .md / .pdf / .html files
TOP_K = 10

# 1. Index the documents: chunked (64 embedder tokens, as the sweep below: one index), embedded
#    by the embedded MiniLM, FAISS, kept in the ragfix cache (never in the folder).
index = build_corpus(DOCS).index

# 2. Ask with the embedded SmolLM2; RagFixPostprocessor goes last among the postprocessors.
backend = load_backend("vanilla")  # model="smollm2"
post = RagFixPostprocessor(strategy="lost-in-the-middle", backend=backend)
engine = index.as_query_engine(
    llm=RagFixLLM(backend, max_new_tokens=32, stop_at_newline=True),
    similarity_top_k=TOP_K,
    node_postprocessors=[post],
    text_qa_template=text_qa_template(),  # the prompt the position curves are measured with
)
response = engine.query("who invented the cornell method of note taking")
print(f"answer: {response.response}")
for position, (rank, hit) in enumerate(
    zip(post.last_report["order"], response.source_nodes, strict=True)
):
    print(f"  prompt position {position}: retrieval rank {rank}: {hit.node.metadata['title']}")

# 3. The curve over the same documents: questions with their answers and gold document (one JSON
#    object per line; "gold_text" can name the passage instead of "gold_doc_id"). Each gold chunk
#    is moved to retrieval rank 0 (first) and 9 (last), with and without the reordering. Two
#    questions show the mechanics; a curve to act on needs more (docs/middleware.md: all 10
#    ranks, ragfix eval-pipeline --corpus demo --questions demo).
QUESTIONS = [
    {
        "question": "who invented the cornell method of note taking",
        "answers": ["Walter Pauk"],
        "gold_doc_id": "nq-oracle-0214",
    },
    {
        "question": "when does the movie jeepers creepers come out",
        "answers": ["September 26, 2017"],
        "gold_doc_id": "nq-oracle-0202",
    },
]
questions = Path("runs/quickstart-questions.jsonl")
questions.parent.mkdir(exist_ok=True)
questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
summary = run_pipeline_sweep(
    DOCS,
    questions,
    Path("runs/quickstart"),
    strategies=["none", "lost-in-the-middle"],
    top_k=TOP_K,
    positions="first,last",
)
for label, curve in summary["curves"].items():
    accuracy = {p["position"]: p["accuracy"] for p in curve["positions"]}
    print(
        f"{label}: gold at retrieval rank 0: {accuracy[0]:.2f}, at rank {TOP_K - 1}: "
        f"{accuracy[TOP_K - 1]:.2f}"
    )
