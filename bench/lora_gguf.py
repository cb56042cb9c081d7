"""Check: a LoRA exported as GGUF (:func:`ragfix.export.export_gguf_lora`) acts in llama.cpp as
the adapter acts in ragfix.

llama.cpp (``llama-cpp-python``, an optional install) reads the base GGUF as it is (its
quantized weights; the embedded models' GGUF files) with and without ``--lora``; ragfix reads the
same GGUF dequantized, without and with the adapter. Both read the same token ids (ragfix's
encoding of KV-retrieval prompts of the bundled sample, chat template included). Per prompt:
the next-token distributions, and the *shift* the adapter causes in each runtime (adapted minus
base log-probabilities). The shifts should agree far above what the quantization leaves; as a
negative control, the same LoRA written without llama.cpp's q/k row order (as for an
architecture that keeps Hugging Face's order) should not.

    ragfix bench lora-gguf adapters/smollm2-kv8-r1 --model smollm2 --json results/x.json
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from ragfix.bench.remote import kv_prompts
from ragfix.errors import ConfigError
from ragfix.tables import TableSpec


def _llama_cpp_logprobs(base_gguf: Path, lora: Path | None, prompts: list[list[int]]):
    """``[len(prompts), vocab]`` next-token log-probabilities from llama.cpp, one prompt at a
    time (one thread), with the LoRA file applied when given."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(base_gguf),
        lora_path=None if lora is None else str(lora),
        n_ctx=max(map(len, prompts)) + 8,
        n_threads=1,
        n_batch=512,
        logits_all=False,
        verbose=False,
    )
    rows = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        logits = torch.tensor(llm.scores[llm.n_tokens - 1], dtype=torch.float32)
        rows.append(torch.log_softmax(logits, dim=-1))
    del llm
    return torch.stack(rows)


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
    progress: Callable[[str], object] = lambda _: None,
) -> tuple[TableSpec, dict]:
    """The adapter's next-token shift in ragfix (merged, fp32) and in llama.cpp (base GGUF plus
    the exported GGUF LoRA) on ``prompts`` KV prompts of ``num_docs`` pairs.

    Args:
        adapter: the LoRA folder.
        model: the base model as ragfix names it.
        base_gguf: the GGUF llama.cpp reads (default: ``model``'s own file when it is one).
        prompts, num_docs: the KV prompts (gold at each position in turn).
        progress: called with a short status.

    Returns:
        ``(table, details)``.

    Raises:
        ConfigError: no GGUF for ``model`` and none given; llama.cpp not installed.
    """
    from ragfix.backends import load_backend
    from ragfix.export import GGUF_ARCHITECTURES, export_gguf_lora
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
    prompt_list = kv_prompts(prompts, num_docs)
    progress("ragfix: base and adapted")
    ours = {}
    for label, kw in (("base", {}), ("adapted", {"adapter": str(adapter)})):
        backend = load_backend("vanilla", model=model, device="cpu", dtype="float32", **kw)
        ours[label] = backend.next_token_logprobs(prompt_list, batch_size=1)
        if label == "base":
            ids = [backend.encode(p) for p in prompt_list]
        del backend
    arch = load_config(model).architectures[0]
    theirs = {}
    with tempfile.TemporaryDirectory() as tmp:
        right = export_gguf_lora(adapter, model, Path(tmp) / "lora.gguf")
        name, permuted = GGUF_ARCHITECTURES[arch]
        control = None
        if permuted:  # the same LoRA in Hugging Face's q/k row order
            with mock.patch.dict(GGUF_ARCHITECTURES, {arch: (name, False)}):
                export_gguf_lora(adapter, model, Path(tmp) / "hf-rows.gguf")
            control = Path(tmp) / "hf-rows.gguf"
        for label, lora in (("base", None), ("adapted", Path(right["file"])), ("control", control)):
            if label == "control" and control is None:
                continue
            progress(f"llama.cpp: {label}")
            theirs[label] = _llama_cpp_logprobs(Path(base_gguf), lora, ids)
    shift = ours["adapted"] - ours["base"]
    top = ours["adapted"].topk(TOP, dim=-1).indices
    rows = [
        _row("base: ragfix (dequantized, fp32) vs llama.cpp", ours["base"], theirs["base"], top),
        _row(
            "adapted: ragfix merged vs llama.cpp + GGUF LoRA",
            ours["adapted"],
            theirs["adapted"],
            top,
        ),
        _row(
            "the adapter's shift: ragfix vs llama.cpp",
            shift,
            theirs["adapted"] - theirs["base"],
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
    details = {
        "adapter": str(adapter),
        "model": model,
        "base_gguf": str(base_gguf),
        "gguf_lora": {k: v for k, v in right.items() if k != "file"},
        "prompts": len(ids),
        "num_docs": num_docs,
        "measurements": rows,
    }
    return lora_gguf_table(details), details


def lora_gguf_table(details: dict) -> TableSpec:
    """The check's table from its figures."""
    n = details["prompts"]
    return TableSpec(
        f"{details['model']} + {Path(details['adapter']).name}: ragfix vs llama.cpp, next-token "
        f"log-probabilities on {n} KV prompts ({details['num_docs']} pairs)",
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
    )
