"""Perplexity by length beyond the trained window: vanilla, GALI and the RoPE-scaling baselines.

The long-text perplexity test of GALI (arXiv 2502.02659, PG19 experiment), run on any JSON Lines
file of long texts (field ``text``), e.g. the Paul Graham essays in ``data/``. The essays
are concatenated in file order and tokenized once; sample ``k`` reads the tokens from offset
``k * max_length``, and every length is a prefix of that same text, so the rows of the table
differ by length and method only.

Reported per (method, length): perplexity over all predicted tokens of the window (``ppl``) and
over its last quarter (``ppl_tail``, the tokens furthest beyond the window).

Every method is scored through the model interface only (``tokenize``, ``token_logprobs``,
``identity``): GALI's chunked loop or a RoPE variant is the backend's business.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from pathlib import Path

import torch

from ragfix.backends import Backend, load_backend
from ragfix.connectors.jsonl import read_jsonl, require
from ragfix.errors import ConfigError, DataError
from ragfix.io import atomic_write_json, atomic_write_text

#: method name -> (backend, options); rope factors are filled in from the longest ratio
METHODS: dict[str, tuple[str, dict]] = {
    "vanilla": ("vanilla", {}),
    "gali": ("gali", {}),
    "linear": ("rope-scaled", {"rope_type": "linear"}),
    "dynamic": ("rope-scaled", {"rope_type": "dynamic"}),
    "yarn": ("rope-scaled", {"rope_type": "yarn"}),
}


def read_texts(path: str | Path) -> str:
    """The ``text`` fields of a JSON Lines file, joined by blank lines.

    Raises:
        DataError: a line that is not a JSON object or lacks a non-empty ``text`` string.
    """
    texts = [require(rec, "text", str, path, line) for line, rec in read_jsonl(path)]
    if not texts:
        raise DataError(path, None, None, "no records")
    return "\n\n".join(texts)


def trained_window(backend: Backend) -> int:
    """``L`` of the length grid: the backend's ``train_window`` option where it has one (GALI,
    the RoPE baselines), else its ``context_window`` (the model's trained window)."""
    return int(backend.identity()["options"].get("train_window") or backend.context_window)


def _ppl(logp: torch.Tensor) -> float:
    return math.exp(-logp.double().mean().item())


def run_ppl(
    data: str | Path,
    model: str = "smollm2",
    train_window: int | None = None,
    ratios: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0),
    methods: tuple[str, ...] = ("vanilla", "gali", "linear", "dynamic", "yarn"),
    samples: int = 2,
    gali_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
    on_step: Callable[[str], None] | None = None,
) -> list[dict]:
    """Perplexity of each method at each length ``ratio * L``.

    Args:
        data: JSON Lines file of long texts (field ``text``).
        model: model name (see :func:`ragfix.models.load_model`).
        train_window: ``L`` (default: the model's ``max_position_embeddings``); GALI and the RoPE
            baselines extend it to ``max(ratios) * L`` (rope ``factor = max(ratios)``).
        ratios: lengths as multiples of ``L``.
        methods: keys of :data:`METHODS`.
        samples: text windows per length (disjoint, same offsets for every method).
        gali_options: extra options of the ``gali`` backend (``noise``, ``chunk_size`` ...).
        on_step: called with a short status after each (method, length, sample).

    Returns:
        one row per (method, ratio): ``method, ratio, length, ppl, ppl_tail, samples``.

    Raises:
        ConfigError: unknown method, or no positive ratio.
        DataError: bad data file, or the text is too short for ``samples`` windows.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if not ratios or min(ratios) <= 0:
        raise ConfigError(f"ratios {list(ratios)}: give one or more positive multiples of L")
    text = read_texts(data)
    rows = []
    for method in methods:
        name, opts = METHODS[method]
        opts = dict(opts)
        if name != "vanilla":
            opts["train_window"] = train_window
        if name == "rope-scaled":
            opts["factor"] = max(ratios)
        if name == "gali":
            if train_window:
                opts["target_window"] = int(max(ratios) * train_window)
            opts.update(gali_options or {})
        backend = load_backend(name, model=model, device=device, dtype=dtype, **opts)
        big_l = train_window or trained_window(backend)
        lengths = [max(2, int(r * big_l)) for r in ratios]
        longest = max(lengths)
        # ~4 characters per token in English prose: tokenize a generous prefix only
        tokens = backend.tokenize(text[: samples * longest * 12])
        if len(tokens) < samples * longest:
            raise DataError(
                data,
                None,
                None,
                f"{len(tokens)} tokens, need {samples} x {longest} for {samples} samples",
            )
        for ratio, length in zip(ratios, lengths, strict=True):
            all_lp, tails = [], []
            for k in range(samples):
                ids = tokens[k * longest : k * longest + length]
                lp = backend.token_logprobs(ids)
                all_lp.append(lp)
                tails.append(lp[-max(1, len(lp) // 4) :])
                if on_step:
                    on_step(f"{method} {length} tok, sample {k + 1}: ppl {_ppl(lp):.2f}")
            rows.append(
                {
                    "method": method,
                    "ratio": ratio,
                    "length": length,
                    "ppl": _ppl(torch.cat(all_lp)),
                    "ppl_tail": _ppl(torch.cat(tails)),
                    "samples": samples,
                    "train_window": big_l,
                    "options": backend.identity()["options"],
                }
            )
        del backend
        gc.collect()
    return rows


def table_markdown(rows: list[dict], key: str = "ppl") -> str:
    """Markdown table: one row per method, one column per length, values of ``key``."""
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    val = {(r["method"], r["length"]): r[key] for r in rows}
    lines = [
        f"| method | {' | '.join(f'{n} tok' for n in lengths)} |",
        "|---|" + "---:|" * len(lengths),
    ]
    for m in methods:
        cells = [f"{val[m, n]:.2f}" if (m, n) in val else "" for n in lengths]
        lines.append(f"| {m} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def plot_ppl(rows: list[dict], path: str | Path) -> None:
    """Line plot of perplexity against length per method (log y), with the window marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["length"], r["ppl"]) for r in rows if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.axvline(rows[0]["train_window"], color="grey", ls="--", lw=1, label="trained window L")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity by length")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(rows: list[dict], out: str | Path) -> dict[str, Path]:
    """Write ``ppl.json``, ``ppl.md`` (both tables) and ``ppl.png`` into ``out``."""
    out = Path(out)
    paths = {"json": out / "ppl.json", "md": out / "ppl.md", "png": out / "ppl.png"}
    atomic_write_json(paths["json"], rows)
    md = "Perplexity (all tokens)\n\n" + table_markdown(rows, "ppl")
    md += "\nPerplexity (last quarter of each window)\n\n" + table_markdown(rows, "ppl_tail")
    atomic_write_text(paths["md"], md)
    plot_ppl(rows, paths["png"])
    return paths
