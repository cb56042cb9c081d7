"""Check: a LoRA exported for llama.cpp (:func:`ragfix.export.export_gguf_lora`, a GGUF LoRA;
:func:`ragfix.export.export_merged_gguf`, the base GGUF with the LoRA merged) acts in llama.cpp as
the adapter acts in ragfix.

llama.cpp (``llama-cpp-python``, an optional install) reads the base GGUF as it is (its
quantized weights; the embedded models' GGUF files) without and with ``--lora``, and the merged
GGUF; ragfix reads the same GGUF dequantized, without and with the adapter. Both read the same
token ids (ragfix's encoding of KV-retrieval prompts, chat template included). Per prompt: the
next-token distributions, the *shift* the adapter causes in each runtime (adapted minus base
log-probabilities), and the greedy answer, scored as a sweep scores it. The shifts should agree
far above what the quantization leaves; as a negative control, the same LoRA written without
llama.cpp's q/k row order (as for an architecture that keeps Hugging Face's order) should not.

    ragfix bench lora-gguf adapters/smollm2-kv8-r1 --data data/litm_kv_retrieval_140_keys.jsonl.gz \
        --records 200:208 --prompts 64 --json results/x.json
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from ragfix.backends.base import final_answer
from ragfix.bench.remote import kv_cells
from ragfix.errors import ConfigError
from ragfix.tables import TableSpec
from ragfix.tasks import score_answer


def _llama_cpp(gguf_file: Path, lora: Path | None, prompts: list[list[int]], max_new: int):
    """llama.cpp's ``[len(prompts), vocab]`` next-token log-probabilities and greedy answers
    (token ids, at most ``max_new``, ending at the end-of-sequence token or at the first token
    holding a newline) for the token-id prompts, one at a time (one thread), with the LoRA file
    applied when given. ``logits_all``: llama-cpp-python keeps no logits in ``scores`` without
    it."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf_file),
        lora_path=None if lora is None else str(lora),
        n_ctx=max(map(len, prompts)) + max_new + 8,
        n_threads=1,
        n_batch=512,
        logits_all=True,
        verbose=False,
    )
    rows, answers = [], []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        logits = torch.tensor(llm.scores[llm.n_tokens - 1], dtype=torch.float32)
        rows.append(torch.log_softmax(logits, dim=-1))
        answer: list[int] = []
        while len(answer) < max_new:
            token = int(llm.scores[llm.n_tokens - 1].argmax())
            if token == llm.token_eos():
                break
            answer.append(token)
            if b"\n" in llm.detokenize([token]):
                break
            llm.eval([token])
        answers.append(answer)
    del llm
    return torch.stack(rows), answers


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()))


#: the tokens compared per prompt: the most likely under ragfix's adapted model (the far tail of
#: a 49k vocabulary is quantization noise, not what the adapter decides)
TOP = 100


def _row(name: str, mine: torch.Tensor, theirs: torch.Tensor, top: torch.Tensor) -> dict:
    """Agreement of two ``[n, vocab]`` tensors over the ``top`` ``[n, TOP]`` token ids of each
    row: the same argmax (over the whole vocabulary), the mean Pearson r and the largest
    absolute difference over the top tokens."""
    a, b = mine.gather(1, top), theirs.gather(1, top)
    return {
        "compared": name,
        "same_top_token": int((mine.argmax(-1) == theirs.argmax(-1)).sum()),
        "pearson_r": round(sum(_pearson(x, y) for x, y in zip(a, b, strict=True)) / len(a), 4),
        "max_abs_diff": round(float((a - b).abs().max()), 4),
    }


def bench_lora_gguf(
    adapter: str | Path,
    model: str = "smollm2",
    base_gguf: str | Path | None = None,
    prompts: int = 8,
    num_docs: int = 8,
    data: str | Path | None = None,
    records: str | None = None,
    merged_type: str = "f16",
    progress: Callable[[str], object] = lambda _: None,
) -> tuple[list[TableSpec], dict]:
    """The adapter in ragfix (merged into the dequantized GGUF's weights, fp32) and in llama.cpp
    (the base GGUF plus the exported GGUF LoRA; the merged GGUF) on ``prompts`` KV prompts.

    Args:
        adapter: the LoRA folder.
        model: the base model as ragfix names it.
        base_gguf: the GGUF llama.cpp reads (default: ``model``'s own file when it is one).
        prompts, num_docs: the KV prompts (each sample's gold pair at each position in turn).
        data, records: the KV file and record range (default: the bundled sample).
        merged_type: the merged tensors' type in the merged GGUF
            (:data:`~ragfix.export.MERGED_GGUF_TYPES`).
        progress: called with a short status.

    Returns:
        ``([distributions table, answers table], details)``.

    Raises:
        ConfigError: no GGUF for ``model`` and none given; llama.cpp not installed; see
            :func:`~ragfix.export.export_merged_gguf`.
    """
    from ragfix.backends import load_backend
    from ragfix.export import GGUF_ARCHITECTURES, export_gguf_lora, export_merged_gguf
    from ragfix.models.resolve import load_config, resolve_model

    if importlib.util.find_spec("llama_cpp") is None:  # before any model is loaded
        raise ConfigError(
            "this check runs llama.cpp: pip install llama-cpp-python (CMAKE_ARGS="
            '"-DGGML_NATIVE=OFF" where its default build stops)'
        )
    spec = resolve_model(model)
    if base_gguf is None:
        if spec.source != "gguf":
            raise ConfigError(f"{model} is not a GGUF: give --base-gguf, the file llama.cpp reads")
        base_gguf = spec.path
    cells = kv_cells(prompts, num_docs, data, records)
    prompt_list = [prompt for _, prompt in cells]
    max_new = prompt_list[0].max_new_tokens
    ours, answers = {}, {}
    for label, kw in (("base", {}), ("adapted", {"adapter": str(adapter)})):
        progress(f"ragfix: {label}")
        backend = load_backend("vanilla", model=model, device="cpu", dtype="float32", **kw)
        ours[label] = backend.next_token_logprobs(prompt_list, batch_size=1)
        generated = backend.generate(prompt_list, batch_size=1, prefix_reuse=True)
        answers[f"ragfix {label}"] = [g.text for g in generated]
        if label == "base":
            ids = [backend.encode(p) for p in prompt_list]
            del backend  # the adapted one is kept: it decodes llama.cpp's answers
    arch = load_config(model).architectures[0]
    theirs = {}
    with tempfile.TemporaryDirectory() as tmp:
        right = export_gguf_lora(adapter, model, Path(tmp) / "lora.gguf")
        progress(f"merging into the base GGUF ({merged_type})")
        merged = export_merged_gguf(
            adapter, model, Path(tmp) / "merged.gguf", base_gguf=base_gguf, tensor_type=merged_type
        )
        name, permuted = GGUF_ARCHITECTURES[arch]
        runs = {
            "base": (base_gguf, None),
            "+ GGUF LoRA": (base_gguf, Path(right["file"])),
            "merged GGUF": (merged["file"], None),
        }
        if permuted:  # the same LoRA in Hugging Face's q/k row order
            with mock.patch.dict(GGUF_ARCHITECTURES, {arch: (name, False)}):
                export_gguf_lora(adapter, model, Path(tmp) / "hf-rows.gguf")
            runs["control"] = (base_gguf, Path(tmp) / "hf-rows.gguf")
        for label, (gguf_file, lora) in runs.items():
            progress(f"llama.cpp: {label}")
            theirs[label], tokens = _llama_cpp(Path(gguf_file), lora, ids, max_new)
            if label != "control":
                answers[f"llama.cpp {label}"] = [
                    final_answer(backend.detokenize(t), p.stop_at_newline)[0]
                    for t, p in zip(tokens, prompt_list, strict=True)
                ]
    del backend
    shift = ours["adapted"] - ours["base"]
    top = ours["adapted"].topk(TOP, dim=-1).indices
    rows = [
        _row("base: ragfix (dequantized, fp32) vs llama.cpp", ours["base"], theirs["base"], top),
        _row(
            "adapted: ragfix vs llama.cpp + GGUF LoRA", ours["adapted"], theirs["+ GGUF LoRA"], top
        ),
        _row(
            "the adapter's shift: ragfix vs llama.cpp + GGUF LoRA",
            shift,
            theirs["+ GGUF LoRA"] - theirs["base"],
            top,
        ),
        _row(
            f"adapted: ragfix vs llama.cpp merged GGUF ({merged_type})",
            ours["adapted"],
            theirs["merged GGUF"],
            top,
        ),
        _row(
            "the adapter's shift: ragfix vs llama.cpp merged GGUF",
            shift,
            theirs["merged GGUF"] - theirs["base"],
            top,
        ),
    ]
    if "control" in theirs:
        rows.append(
            _row(
                "control, q/k rows in Hugging Face order: shift",
                shift,
                theirs["control"] - theirs["base"],
                top,
            )
        )
    reference = answers["ragfix adapted"]
    answer_rows = [
        {
            "runtime": label,
            "correct": sum(
                score_answer(sample, a) for (sample, _), a in zip(cells, texts, strict=True)
            ),
            "same_as_ragfix_adapted": sum(a == b for a, b in zip(texts, reference, strict=True)),
        }
        for label, texts in answers.items()
    ]
    details = {
        "adapter": str(adapter),
        "model": model,
        "base_gguf": str(base_gguf),
        "data": str(data) if data else "kv-sample",
        "records": records,
        "gguf_lora": {k: v for k, v in right.items() if k != "file"},
        "merged_gguf": {k: v for k, v in merged.items() if k not in ("file", "base_gguf")},
        "prompts": len(ids),
        "num_docs": num_docs,
        "measurements": rows,
        "answers": answer_rows,
    }
    return lora_gguf_tables(details), details


def lora_gguf_tables(details: dict) -> list[TableSpec]:
    """The check's tables from its figures: the distributions, then the answers."""
    n = details["prompts"]
    where = details["data"] + (f", records {details['records']}" if details["records"] else "")
    return [
        TableSpec(
            f"{details['model']} + {Path(details['adapter']).name}: ragfix vs llama.cpp, "
            f"next-token log-probabilities on {n} KV prompts ({details['num_docs']} pairs; "
            f"{where})",
            ["compared", "same top token", f"mean Pearson r (top {TOP})", "largest |difference|"],
            [
                [
                    r["compared"],
                    f"{r['same_top_token']}/{n}",
                    f"{r['pearson_r']:.4f}",
                    f"{r['max_abs_diff']:.3f}",
                ]
                for r in details["measurements"]
            ],
        ),
        TableSpec(
            f"greedy answers on the same {n} prompts",
            ["runtime", "correct", "accuracy", "same answer as ragfix adapted"],
            [
                [
                    r["runtime"],
                    f"{r['correct']}/{n}",
                    f"{r['correct'] / n:.3f}",
                    f"{r['same_as_ragfix_adapted']}/{n}",
                ]
                for r in details["answers"]
            ],
        ),
    ]
