"""Which backend runs on which model family: the capability table and ``ragfix models --check``.

A backend's verdict on a model comes from its config alone (``check_family``: nothing loaded), so
``ragfix models --check MODEL`` answers for any checkpoint folder, GGUF file or hub id without a
sweep. The capability table (``ragfix bench families``) adds the proof: every family as a tiny
random-config model (2 layers, hidden 64, grouped-query attention; Mistral's and Gemma 3's
sliding window 128 tokens, shorter than the probe's prompts), every backend run on it in fp32
and bf16 with ``sdpa`` and ``eager`` attention, and in bf16 with ``sdpa_fp32_decode`` (what
:func:`~ragfix.models.load.load_model` gives a bf16 model on the CPU), through every path
(batched generation, prefix reuse one prompt at a time and batched, next-token
log-probabilities, log-likelihood, streaming the generated answer); a cell
says ``works`` only when all of them ran, and a refusal is the backend's one-line reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ragfix.models.device import SDPA_FP32_DECODE
from ragfix.tables import TableSpec

#: the families of the capability table, in its order
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
#: the sliding window of the tiny Mistral and Gemma 3 models (tokens)
TINY_WINDOW = 128
#: the dtypes and attention implementations every cell runs under
VARIANTS = (
    (torch.float32, "sdpa"),
    (torch.float32, "eager"),
    (torch.bfloat16, "sdpa"),
    (torch.bfloat16, SDPA_FP32_DECODE),  # what ragfix loads a bf16 model with on the CPU
    (torch.bfloat16, "eager"),
)
#: backends that need an artefact the table does not make, and the options it gives them
PROBE_OPTIONS = {"channel-scaled": {"channel": 3}}
#: backends left out of the table: an adapter over ``vanilla`` (its row is vanilla's)
NOT_PROBED = ("pos2distill",)


def tiny_config(family: str, vocab_size: int = 256, window: int = 2048, **ids):
    """A small random-config decoder of ``family`` (2 layers, hidden 64, 4 query heads over 2
    KV heads; ``window`` positions): Mistral slides every layer over :data:`TINY_WINDOW`
    tokens, Gemma 3 its first (local) layer with its own RoPE base; Qwen3 and Gemma 3 norm q
    and k; Phi-3 fuses q, k, v.

    Args:
        family: one of :data:`FAMILIES`.
        vocab_size: the vocabulary (a real tokenizer's size to read real prompts).
        **ids: ``pad_token_id``, ``bos_token_id``, ``eos_token_id``.

    Raises:
        KeyError: an unknown family.
    """
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        **{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **ids},
    )
    build = {
        "llama": lambda: LlamaConfig(**kw),
        "mistral": lambda: MistralConfig(sliding_window=TINY_WINDOW, **kw),
        "qwen2": lambda: Qwen2Config(**kw),
        "qwen3": lambda: Qwen3Config(head_dim=16, **kw),
        "gemma3": lambda: Gemma3TextConfig(
            head_dim=16,
            sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **kw,
        ),
        "phi3": lambda: Phi3Config(**kw),
    }
    return build[family]()


def tiny_family_model(
    family: str, tokenizer, dtype=torch.float32, attn: str = "sdpa", seed=0, device="cpu"
):
    """A seeded tiny model of ``family`` (:func:`tiny_config`) over ``tokenizer``'s vocabulary,
    in eval mode, in ``dtype`` with attention ``attn``, on ``device`` (weights drawn on the CPU,
    so every device gets the same ones)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(
        family,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    import ragfix.models.attention  # noqa: F401  (registers SDPA_FP32_DECODE with transformers)

    cfg._attn_implementation = attn
    return AutoModelForCausalLM.from_config(cfg).eval().to(device=device, dtype=dtype)


def probed_backends() -> list[str]:
    """The backends of the capability table, in registry order."""
    from ragfix.backends import backend_names

    return [b for b in backend_names() if b not in NOT_PROBED]


def verdict(backend: str, config, options: dict | None = None) -> str | None:
    """``None`` when ``backend`` runs on a model of ``config``'s family, else its one-line
    refusal (:class:`~ragfix.errors.UnsupportedModelError`), from the config alone."""
    from ragfix.backends import backend_spec
    from ragfix.backends.family import read_family
    from ragfix.errors import UnsupportedModelError

    cls = backend_spec(backend).resolve()
    opts = cls.options_model(**(options if options is not None else PROBE_OPTIONS.get(backend, {})))
    try:
        cls.check_family(read_family(config), opts)
    except UnsupportedModelError as e:
        return str(e)
    return None


def check_model(name: str) -> tuple[object, list[tuple[str, str | None]]]:
    """What ``ragfix models --check NAME`` prints: the model's family and every backend's
    verdict (:func:`verdict`), from its config alone.

    Returns:
        ``(family, [(backend, refusal or None), ...])``.

    Raises:
        ModelNotFoundError: the model cannot be found.
    """
    from ragfix.backends import backend_names
    from ragfix.backends.family import read_family
    from ragfix.models.resolve import load_config

    config = load_config(name)
    return read_family(config), [(b, verdict(b, config)) for b in backend_names()]


def probe_cell(backend: str, model, tokenizer, prompts: Sequence) -> None:
    """Run ``backend`` over ``model`` through every path the table checks (see the module
    docstring).

    Raises:
        UnsupportedModelError: the backend refuses the family.
        Exception: anything else the backend raised (a failing cell).
    """
    from ragfix.backends import backend_spec

    cls = backend_spec(backend).resolve()
    b = cls(model, tokenizer, options=cls.options_model(**PROBE_OPTIONS.get(backend, {})))
    b.generate(prompts, batch_size=len(prompts), max_new_tokens=3)
    b.generate(prompts, batch_size=1, max_new_tokens=3, prefix_reuse=True)
    b.generate(prompts, batch_size=len(prompts), max_new_tokens=3, prefix_reuse=True)
    b.next_token_logprobs(prompts)
    b.loglikelihood([(prompts[0], " value")])
    streamed = "".join(b.stream(prompts[0], max_new_tokens=3, stop_at_newline=False))
    [answer] = b.generate(prompts[:1], max_new_tokens=3, stop_at_newline=False)
    if streamed.strip() != answer.text.strip():
        raise AssertionError(f"streamed {streamed!r}, generated {answer.text!r}")


def probe_prompts() -> list:
    """Three KV prompts of the bundled sample (8 pairs, the gold pair first, fourth and last):
    longer than :data:`TINY_WINDOW` tokens."""
    from ragfix.bundled import resolve_data
    from ragfix.connectors.litm import load_samples
    from ragfix.tasks import task_prompt

    sample = load_samples(resolve_data("kv-sample"), 8, 1)[0]
    return [task_prompt(sample, sample.passages_with_gold_at(p)) for p in (0, 3, 7)]


def bench_families(
    families: Sequence[str] = FAMILIES, progress: Callable[[str], None] = lambda s: None
) -> tuple[TableSpec, dict]:
    """The capability table (module docstring): family x backend, each cell run under every
    :data:`VARIANTS` entry on the real SmolLM2 tokenizer.

    Returns:
        ``(table, details)``: cells ``works`` or ``refuses (n)``, the refusals under it as
        lines; ``details["cells"][family][backend]`` is ``{"works": bool, "reason": str|None}``
        (a cell that raised anything else than a refusal is ``works: false`` with its error).
    """
    from ragfix.errors import UnsupportedModelError
    from ragfix.models.load import load_tokenizer

    tok = load_tokenizer("smollm2")
    prompts = probe_prompts()
    backends = probed_backends()
    cells: dict[str, dict[str, dict]] = {}
    for fam in families:
        cells[fam] = {}
        for name in backends:
            progress(f"{fam} · {name}")
            reason, failed = None, None
            for dtype, attn in VARIANTS:
                model = tiny_family_model(fam, tok, dtype, attn)
                try:
                    probe_cell(name, model, tok, prompts)
                except UnsupportedModelError as e:
                    reason = str(e)
                    break
                except Exception as e:  # a failing cell is reported, not hidden
                    failed = f"{str(dtype)[6:]} {attn}: {type(e).__name__}: {e}".splitlines()[0]
                    break
            cells[fam][name] = {"works": reason is None and failed is None, "reason": reason}
            if failed:
                cells[fam][name]["error"] = failed
    return capability_table(cells, backends), {"cells": cells, "window": TINY_WINDOW}


def capability_table(cells: dict, backends: Sequence[str]) -> TableSpec:
    """The family x backend table of :func:`bench_families`'s cells, the refusals numbered
    under it."""
    from ragfix.backends.family import family_name

    reasons: list[str] = []
    rows = []
    for fam, row in cells.items():
        out = [family_name(tiny_config(fam))]
        for b in backends:
            cell = row[b]
            if cell["works"]:
                out.append("works")
            else:
                text = cell.get("reason") or f"FAILS: {cell.get('error')}"
                if text not in reasons:
                    reasons.append(text)
                out.append(
                    f"refuses ({reasons.index(text) + 1})" if cell.get("reason") else "FAILS"
                )
        rows.append(out)
    return TableSpec(
        title="backends by model family (tiny random-config models, fp32 and bf16, sdpa and eager)",
        headers=["family", *backends],
        rows=rows,
        lines=[f"({i}) {r}" for i, r in enumerate(reasons, 1)],
    )


__all__ = [
    "FAMILIES",
    "TINY_WINDOW",
    "VARIANTS",
    "bench_families",
    "capability_table",
    "check_model",
    "probe_cell",
    "probe_prompts",
    "tiny_config",
    "tiny_family_model",
    "verdict",
]
