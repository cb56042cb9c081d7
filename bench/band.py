"""Benchmark: a sliding-window model's prefill under SDPA with its layers' masks against banded
SDPA (:mod:`ragfix.models.attention`), per prompt length and rows per block, in one process.

Each length prefills the same seeded token ids (the cost of attention does not depend on what
the tokens say) under SDPA (the implementation the model would get without banding:
:func:`~ragfix.models.device.default_attention` of a model without sliding layers) and under
banded SDPA with each number of rows per block, the best of ``repeats`` timings each. Prints
seconds per prefill, the ratio against SDPA, and the agreement of the last token's logits with
SDPA's (the largest absolute difference, the same argmax), and keeps the table as a result file;
:data:`ragfix.models.attention.BAND_ROWS` is the measured best row count.

    ragfix bench band --model gemma3-270m --dtype bfloat16 --lengths 1000,2000,3500 \
        --rows 128,256,512 --json results/bench-band-gemma3-bf16.json
"""

from __future__ import annotations

import time
from functools import partial

import torch

from ragfix.tables import TableSpec, fmt_num


def banded_name(rows: int) -> str:
    """Register banded SDPA with ``rows`` query rows per block with transformers (attention
    function and mask) and return the name it is registered under."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    from ragfix.models.attention import sdpa_banded
    from ragfix.models.device import SDPA_BANDED

    name = f"{SDPA_BANDED}_{rows}"
    AttentionInterface.register(name, partial(sdpa_banded, band_rows=rows))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@torch.no_grad()
def _prefill(model, attention: str, ids: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """The best of ``repeats`` wall times (s) of one prefill of ``ids`` under ``attention``, and
    the last token's float32 logits."""
    model.set_attn_implementation(attention)
    best, logits = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        best = min(best, time.perf_counter() - start)
    return best, logits


def bench_band(
    model: str,
    device: str,
    dtype: str,
    lengths: list[int],
    rows: list[int],
    repeats: int = 2,
    on_progress=None,
) -> tuple[TableSpec, dict]:
    """Prefill seconds under SDPA and banded SDPA (see the module docstring).

    Returns:
        ``(table, details)``: the table and the raw figures (seconds, logit differences).

    Raises:
        ConfigError: a model without sliding-window layers (banded SDPA is SDPA there), a
            length or row count below 1.
    """
    from ragfix.backends.family import model_family
    from ragfix.errors import ConfigError
    from ragfix.models import load_model
    from ragfix.models.device import default_attention

    if min(lengths + rows, default=0) < 1:
        raise ConfigError("--lengths and --rows: whole numbers of at least 1")
    lm, tok = load_model(model, device=device, dtype=dtype)
    family = model_family(lm)
    if not family.sliding:
        raise ConfigError(f"{model} has no sliding-window layer: banded SDPA is SDPA there")
    baseline = default_attention(lm.device, lm.dtype)
    variants = [(f"banded, {r} rows", banded_name(r)) for r in rows]
    gen = torch.Generator().manual_seed(0)
    _prefill(lm, baseline, torch.ones(1, 64, dtype=torch.long, device=lm.device), 1)  # warm-up
    table_rows, runs = [], []
    for n in lengths:
        ids = torch.randint(len(tok.all_special_ids), len(tok), (1, n), generator=gen)
        ids = ids.to(lm.device)
        if on_progress:
            on_progress(f"{n} tokens: {baseline}")
        base_s, base_logits = _prefill(lm, baseline, ids, repeats)
        table_rows.append([str(n), baseline, fmt_num(base_s), "1.00x", "", ""])
        runs.append({"tokens": n, "attention": baseline, "seconds": base_s})
        for label, name in variants:
            if on_progress:
                on_progress(f"{n} tokens: {label}")
            s, logits = _prefill(lm, name, ids, repeats)
            diff = float((logits - base_logits).abs().max())
            same = bool(logits.argmax() == base_logits.argmax())
            table_rows.append(
                [str(n), label, fmt_num(s), f"{base_s / s:.2f}x", f"{diff:.2e}", str(same)]
            )
            runs.append(
                {
                    "tokens": n,
                    "attention": label,
                    "seconds": s,
                    "max_logit_diff": diff,
                    "same_argmax": same,
                }
            )
    windows = sorted({w for w in family.windows if w is not None})
    table = TableSpec(
        title=f"Prefill of {model} ({lm.dtype}, {lm.device}): SDPA against banded SDPA",
        headers=["tokens", "attention", "seconds", "speed-up", "max |Δ logit|", "same argmax"],
        rows=table_rows,
        lines=[
            f"{sum(w is not None for w in family.windows)} of {len(family.windows)} layers slide "
            f"a window of {', '.join(map(str, windows))} tokens; best of {repeats} prefills of "
            "the same seeded token ids after a warm-up; the last token's logits against SDPA's.",
        ],
    )
    return table, {"runs": runs, "model": model, "dtype": str(lm.dtype)}
