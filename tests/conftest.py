"""Shared fixtures: the real embedded model (loaded once per session), tiny seeded models for
mechanism tests, and the data and case folders."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")  # the tests run offline
if os.environ.get("PYTEST_XDIST_WORKER"):
    # ``pytest -n 2``: one torch thread per worker (and per process a test starts), so the workers
    # do not thrash each other's cores (results/cpu-threads.json)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # and one process per sweep: the xdist workers already hold the cores (the tests of worker
    # processes ask for them)
    os.environ.setdefault("RAGFIX_WORKERS", "1")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
CASES = ROOT / "tests" / "cases"
BUNDLED = ROOT / "ragfix" / "data"

#: five one-sentence documents, one capital city each, for the framework components' tests
CITY_TEXTS = [
    "Berlin is the capital and largest city of Germany.",
    "Madrid is the capital of Spain, on the river Manzanares.",
    "Ottawa is the capital city of Canada, in Ontario.",
    "Canberra is the capital city of Australia.",
    "Nairobi is the capital of Kenya.",
]


def data_file(name: str) -> Path:
    """A file of the repository's ``data/`` (public evaluation data; sources and licences in its
    README). A missing file fails the test: it must never pass by skipping."""
    p = DATA / name
    if not p.exists():
        pytest.fail(f"data file not available: {p} (see data/README.md)")
    return p


def case_file(name: str) -> Path:
    """A file of ``tests/cases`` (failing inputs from public bug reports of similar tools); a
    missing one fails the test."""
    p = CASES / name
    if not p.exists():
        pytest.fail(f"case file not available: {p}")
    return p


def run_records(folder: Path) -> list[dict]:
    """The records of a run folder's ``results.jsonl``, in the file's order."""
    text = (Path(folder) / "results.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def random_ids(n: int, seed: int = 1) -> list[int]:
    """``n`` seeded token ids in [3, 256): the input of the tiny models' mechanism tests."""
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="session")
def smol():
    """The real SmolLM2-135M-Instruct as a vanilla backend on the CPU (loaded once)."""
    from ragfix.backends import load_backend

    torch.manual_seed(0)
    return load_backend("vanilla", model="smollm2", device="cpu")


def tiny_config(arch: str = "llama", **overrides):
    """A small randomly initialised decoder config (2 layers, hidden 64, GQA 4 heads / 2 KV)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }[arch]
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return cls(**kw)


def tiny_model(arch: str = "llama", seed: int = 0, attn: str = "eager", **overrides):
    """A seeded tiny causal LM (fp32, eval mode) built from :func:`tiny_config`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    cfg._attn_implementation = attn
    return AutoModelForCausalLM.from_config(cfg).eval()


def wide_passages_prompt():
    """A ``qa`` task prompt of four repeated passages (about 180 SmolLM2 tokens of passages): wider
    than the tiny models' sliding windows of 64-128 tokens, to test what a method does with the
    passages a window leaves out."""
    from ragfix.tasks import get_task
    from ragfix.types import Passage

    docs = [Passage(title=f"Doc {i}", text="Rivers run to the sea. " * 8) for i in range(4)]
    return get_task("qa").prompt("Which river?", docs)


def essays(chars: int) -> str:
    """Paul Graham essays (the repository's needle data) joined until ``chars`` characters
    (about 4.5 characters a SmolLM2 token)."""
    out = []
    with gzip.open(data_file("needle_paul_graham_essays.jsonl.gz"), "rt") as f:
        for line in f:
            out.append(json.loads(line)["text"])
            if sum(map(len, out)) >= chars:
                break
    return "\n\n".join(out)


def tiny_folder(folder, seed: int = 0, window: int = 2048, arch: str = "llama"):
    """A seeded tiny model of ``arch`` (:func:`tiny_config`) with the real SmolLM2 tokenizer and a
    ``window``-token context, saved as a model folder (``--model FOLDER``); saving again into
    the same folder replaces its weights. Returns the folder."""
    from transformers import AutoTokenizer

    from ragfix.models.resolve import checkpoint_dir, resolve_model

    tok = AutoTokenizer.from_pretrained(checkpoint_dir(resolve_model("smollm2")))
    model = tiny_model(
        arch,
        seed=seed,
        vocab_size=len(tok),
        max_position_embeddings=window,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """A seeded tiny llama (:func:`tiny_folder`: 2 layers, hidden 64, SmolLM2's tokenizer, a
    2048-token window) saved once per session, for the mechanism tests of runs, shards,
    resumes and wrappers that need a model folder (``--model DIR``) but not a model that reads:
    its answers are deterministic and cost about a millisecond a token. Tests must not save
    into it (:func:`tiny_folder` on their own ``tmp_path`` for other seeds or windows)."""
    return str(tiny_folder(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    """A seeded tiny Qwen3 (:func:`tiny_folder`, ``arch="qwen3"``) saved once per session, for
    the tests that compare answers across runs and code paths (resume, prefix reuse, batching,
    shifted positions): its query and key norms make its attention peaked, so its answers
    differ from cell to cell and change with a stale cache entry or a shifted position, where
    :func:`tiny_dir`'s near-uniform attention often leaves them as they were."""
    return str(tiny_folder(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """:func:`tiny_dir` as a vanilla backend on the CPU (loaded once)."""
    from ragfix.backends import load_backend

    return load_backend("vanilla", model=tiny_dir, device="cpu")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_qwen3_dir):
    """:func:`tiny_qwen3_dir` as a vanilla backend on the CPU (loaded once)."""
    from ragfix.backends import load_backend

    return load_backend("vanilla", model=tiny_qwen3_dir, device="cpu")


def gali_query_positions(n: int, big_l: int, w: int, s: int) -> list[float]:
    """The position of every query ``0..n-1`` of a GALI prefill (window ``big_l``, local window
    ``w``, chunks of ``s``) as the chunk that computes it sees it: :func:`gali_positions` of each
    chunk's prefix, independent of the backend's run."""
    from ragfix.backends.gali import chunk_sizes, gali_positions

    out, done = [], 0
    for size in chunk_sizes(n, big_l, s):
        out += gali_positions(done + size, big_l, w)[done : done + size].tolist()
        done += size
    return out


def fractional_queries(n: int, big_l: int, w: int, s: int) -> int:
    """How many of the ``n - 1`` predicted tokens of a GALI-scored text come from a query at a
    fractional position (:func:`gali_query_positions`)."""
    return sum(p != int(p) for p in gali_query_positions(n, big_l, w, s)[:-1])
