"""Perplexity by length beyond the trained window: vanilla, GALI, the RoPE-scaling baselines and
truncation, with intervals over text windows.

The long-text perplexity test of GALI (arXiv 2502.02659, PG19 experiment), run on any JSON Lines
file of long texts (field ``text``), e.g. the Paul Graham essays in ``data/``. The essays are
concatenated in file order and tokenized once; window ``k`` reads the tokens from offset
``k * max_length`` (``max_length`` = the longest length asked), and every length is a prefix of
that same text, so the rows of the table differ by length and method only. A window range
(``windows=range(3, 13)``, ``--windows 3:13``) keeps the windows a setting was tuned on out of
the ones it is reported on: runs with the same longest length read the same window ``k``.

Reported per (method, length), over the windows:

* ``ppl``: perplexity over all predicted tokens, with a 95% percentile bootstrap interval over
  windows (``scipy.stats.bootstrap`` of the mean of the per-window mean NLL, exponentiated);
* ``ppl_tail``: over the last quarter of each window (the tokens furthest beyond the window);
* ``ppl_interp`` / ``ppl_whole``: over the tokens predicted from a query at an interpolated
  (fractional) / whole-number position ID, with their token counts (GALI reports its query
  positions, :meth:`~ragfix.backends.gali.GaliBackend.token_logprobs_with_positions`; every
  other method reads whole-number positions only);
* ``vs_baseline``: the paired comparison with a baseline method on the same windows: the mean
  per-window NLL difference (nats per token) with its bootstrap interval, and the perplexity
  ratio ``exp`` of it.

Methods (:data:`METHODS`): ``vanilla`` (the model at its own positions), ``gali``, ``linear`` /
``dynamic`` / ``yarn`` (transformers' RoPE scaling at ``factor = max(ratios)``) and
``truncated`` (the model held to ``L`` tokens: strided sliding windows, each token predicted from
between ``3L/4`` and ``L - 1`` tokens before it, see :mod:`ragfix.backends.truncated`). GALI
settings can be a grid (:func:`method_variants`): each setting is its own labelled method.

Every method is scored through the model interface only (``tokenize``, ``token_logprobs``,
``identity``): GALI's chunked loop or a RoPE variant is the backend's business.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch
from rich.console import Console

from ragfix.backends import Backend, BackendRef, validate_backend
from ragfix.connectors.jsonl import read_jsonl, require
from ragfix.errors import ConfigError, DataError
from ragfix.eval.merit import Bootstrap, Interval
from ragfix.eval.ppl_tables import PPL_KIND, ppl_tables
from ragfix.eval.run import RunConfig, RunFolder, RunKind, input_fingerprints, run
from ragfix.eval.shard import Shard
from ragfix.io import atomic_write_json, atomic_write_text
from ragfix.tables import markdown_tables

#: method name -> (backend, options); train windows and rope factors are filled in per run
METHODS: dict[str, tuple[str, dict]] = {
    "vanilla": ("vanilla", {}),
    "gali": ("gali", {}),
    "linear": ("rope-scaled", {"rope_type": "linear"}),
    "dynamic": ("rope-scaled", {"rope_type": "dynamic"}),
    "yarn": ("rope-scaled", {"rope_type": "yarn"}),
    "truncated": ("truncated", {}),
}
#: the intervals' settings: percentile bootstrap over text windows, 2000 resamples, seed 0
WINDOW_BOOTSTRAP = Bootstrap(unit="window")


@runtime_checkable
class ReportsQueryPositions(Protocol):
    """A backend that tells, with each token's log-probability, the position ID of the query the
    token was predicted from (GALI: fractional positions beyond the window)."""

    def token_logprobs_with_positions(
        self, ids: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Variant:
    """One scored method: its label in the results, the backend and its options (validated by
    :func:`method_variants`)."""

    label: str
    backend: str
    options: dict


class PplConfig(RunConfig):
    """What makes the windows stored in a perplexity run folder comparable (checked on every
    rerun: :class:`~ragfix.eval.run.RunFolder`). ``identity`` is the model's (weights and chat
    template: every method runs on the same weights); each method's options are in its windows'
    cell ids. The window offsets depend on the longest length, so ``ratios`` is part of it.

    Attributes:
        data: the text file (resolved path); its content is ``inputs["data"]``.
        model: the model name.
        train_window: ``L`` as given (``None``: the model's).
        ratios: the lengths as multiples of ``L``.
    """

    run: Literal["ppl"] = "ppl"
    data: str
    model: str
    train_window: int | None = None
    ratios: list[float]


#: the store of a perplexity run folder: one record per (method, length, window)
WINDOWS_FILE = "windows.jsonl"


def ppl_folder(out: str | Path, config: PplConfig) -> RunFolder:
    """The run folder of a perplexity run: :data:`WINDOWS_FILE` keyed by ``cell_id``; a restart
    also removes the reports (:func:`write_report`)."""
    return RunFolder(
        out, config, results=WINDOWS_FILE, key="cell_id", outputs=("ppl.json", "ppl.md", "ppl.png")
    )


def _window_id(config: PplConfig, variant: Variant, ratio: float, window: int) -> str:
    """Deterministic 16-hex id of one (method, length, window) of a run."""
    request = config.model_dump(mode="json", exclude={"identity", "inputs"})
    key = [request, variant.label, variant.backend, variant.options, ratio, window]
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


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
    the RoPE baselines, truncation), else its ``context_window`` (the model's trained window)."""
    return int(backend.identity()["options"].get("train_window") or backend.context_window)


def parse_windows(text: str) -> range:
    """``"START:STOP"`` to ``range(START, STOP)``: the text windows ``START .. STOP - 1``.

    Raises:
        ConfigError: not two whole numbers with ``0 <= START < STOP``.
    """
    start, sep, stop = text.partition(":")
    try:
        windows = range(int(start), int(stop)) if sep else None
    except ValueError:
        windows = None
    if windows is None or windows.start < 0 or not windows:
        raise ConfigError(
            f"--windows {text!r}: expected START:STOP with 0 <= START < STOP (e.g. 0:3, the "
            "windows 0, 1, 2)"
        )
    return windows


def method_variants(
    methods: Sequence[str],
    *,
    train_window: int | None,
    max_ratio: float,
    gali_options: dict | None = None,
    gali_grid: dict[str, list] | None = None,
) -> list[Variant]:
    """The methods to score, GALI expanded over a grid of its options; every option set is
    validated here, before any weights are loaded.

    Args:
        methods: keys of :data:`METHODS`, in the order to run them.
        train_window: ``L`` given to every method but vanilla (``None``: the model's).
        max_ratio: the longest length over ``L``: the RoPE ``factor`` and GALI's
            ``target_window / L``.
        gali_options: options of every GALI variant (``noise``, ``chunk_size`` ...).
        gali_grid: ``{option: [values]}``: one GALI variant per combination (the product, in the
            order given), labelled ``gali[chunk_size=64,local_window=16]``; without a grid the
            single variant is labelled ``gali``.

    Returns:
        one :class:`Variant` per method (per grid point for ``gali``).

    Raises:
        ConfigError: unknown or repeated method, a grid without ``gali`` among the methods, an
            empty grid list, or an option both in ``gali_options`` and in the grid.
        pydantic.ValidationError: an unknown or invalid backend option.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if repeated:
        raise ConfigError(f"method(s) {repeated} given more than once")
    grid = dict(gali_grid or {})
    if grid and "gali" not in methods:
        raise ConfigError("a GALI grid needs gali among the methods")
    empty = [k for k, v in grid.items() if not v]
    both = sorted(set(grid) & set(gali_options or {}))
    if empty or both:
        what = f"no values for {empty}" if empty else f"{both} set both as an option and a grid"
        raise ConfigError(f"GALI grid: {what}")
    variants = []
    for method in methods:
        name, base = METHODS[method]
        opts = dict(base)
        if name != "vanilla":
            opts["train_window"] = train_window
        if name == "rope-scaled":
            opts["factor"] = max_ratio
        points: list[dict] = [{}]
        if name == "gali":
            if train_window:
                opts["target_window"] = int(max_ratio * train_window)
            opts.update(gali_options or {})
            points = [dict(zip(grid, v, strict=True)) for v in itertools.product(*grid.values())]
        for point in points:
            label = method
            if point:
                label += "[" + ",".join(f"{k}={v}" for k, v in point.items()) + "]"
            full = {**opts, **point}
            validate_backend(name, **full)
            variants.append(Variant(label, name, full))
    return variants


def score_window(backend: Backend, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``ids[1:]`` and the position ID of the query each was predicted from.

    Returns:
        float32 ``[n - 1]`` log-probabilities and float64 ``[n - 1]`` positions: the backend's
        own (:class:`ReportsQueryPositions`) or else ``0 .. n - 2`` (a plain forward pass).

    Raises:
        ValueError: fewer than two tokens.
    """
    if isinstance(backend, ReportsQueryPositions):
        return backend.token_logprobs_with_positions(ids)
    return backend.token_logprobs(ids), torch.arange(len(ids) - 1, dtype=torch.float64)


def window_stats(logp: torch.Tensor, pos: torch.Tensor) -> dict:
    """The sums one text window contributes to its (method, length) figures, as stored in a
    perplexity run folder (one record per window).

    Args:
        logp: float ``[n - 1]`` log-probabilities of the window's tokens (:func:`score_window`).
        pos: ``[n - 1]`` query position IDs they were predicted from.

    Returns:
        ``{"nll": sum of -logp (nats, float64), "tokens": n - 1, "tail_nll", "tail_tokens" (the
        last quarter of the window), "interp_nll", "interp_tokens" (queries at fractional
        positions), "whole_nll", "whole_tokens"}``.
    """
    nll = -logp.double()
    interp = pos != torch.floor(pos)
    tail = nll[-max(1, len(nll) // 4) :]
    return {
        "nll": float(nll.sum()),
        "tokens": len(nll),
        "tail_nll": float(tail.sum()),
        "tail_tokens": len(tail),
        "interp_nll": float(nll[interp].sum()),
        "interp_tokens": int(interp.sum()),
        "whole_nll": float(nll[~interp].sum()),
        "whole_tokens": int((~interp).sum()),
    }


def _ppl(nll: float, tokens: int) -> float | None:
    """Perplexity of a summed NLL over ``tokens`` tokens; ``None`` for none."""
    return math.exp(nll / tokens) if tokens else None


def _interval(values: Sequence[float], boot: Bootstrap) -> Interval | None:
    """Percentile bootstrap interval of the mean of ``values`` (``None`` for fewer than two)."""
    if len(values) < 2:
        return None
    from scipy.stats import bootstrap  # slow to import: not at CLI start

    res = bootstrap(
        (np.asarray(values, dtype=np.float64),),
        np.mean,
        n_resamples=boot.resamples,
        confidence_level=boot.confidence,
        method=boot.method,
        rng=np.random.default_rng(boot.seed),
    )
    ci = res.confidence_interval
    return Interval(low=float(ci.low), high=float(ci.high))


def _exp(iv: Interval | None) -> dict | None:
    return None if iv is None else {"low": math.exp(iv.low), "high": math.exp(iv.high)}


def length_stats(windows: Sequence[dict], boot: Bootstrap | None = None) -> dict:
    """The figures of one (method, length) from its windows' :func:`window_stats`.

    Args:
        windows: per window, :func:`window_stats` of its scores, all windows of the same length.
        boot: bootstrap settings (default :data:`WINDOW_BOOTSTRAP`).

    Returns:
        ``ppl`` with ``ppl_ci`` (``{low, high}``, ``None`` with one window), ``ppl_tail``,
        ``tokens``, ``ppl_interp`` / ``tokens_interp`` and ``ppl_whole`` / ``tokens_whole``
        (a perplexity is ``None`` where it has no token), ``window_nll`` (mean NLL per token of
        each window, nats).
    """
    boot = boot or WINDOW_BOOTSTRAP

    def total(field: str) -> float:
        return sum(w[field] for w in windows)

    window_nll = [w["nll"] / w["tokens"] for w in windows]
    return {
        "ppl": math.exp(float(np.mean(window_nll))),
        "ppl_ci": _exp(_interval(window_nll, boot)),
        "ppl_tail": _ppl(total("tail_nll"), int(total("tail_tokens"))),
        "tokens": int(total("tokens")),
        "ppl_interp": _ppl(total("interp_nll"), int(total("interp_tokens"))),
        "tokens_interp": int(total("interp_tokens")),
        "ppl_whole": _ppl(total("whole_nll"), int(total("whole_tokens"))),
        "tokens_whole": int(total("whole_tokens")),
        "window_nll": window_nll,
    }


def paired_with(rows: list[dict], baseline: str, boot: Bootstrap | None = None) -> None:
    """Add ``vs_baseline`` to every row of another method at a length the baseline has: the
    mean difference of per-window NLL (row - baseline, nats per token; the same windows) with
    its bootstrap interval, and the perplexity ratio ``exp(nll_diff)`` with its interval.

    Raises:
        ConfigError: ``baseline`` is not the label of any row.
    """
    boot = boot or WINDOW_BOOTSTRAP
    base = {r["length"]: r for r in rows if r["method"] == baseline}
    if not base:
        labels = ", ".join(dict.fromkeys(r["method"] for r in rows))
        raise ConfigError(f"baseline {baseline!r} is not among the methods ({labels})")
    for r in rows:
        b = base.get(r["length"])
        if r["method"] == baseline or b is None:
            continue
        diff = np.asarray(r["window_nll"]) - np.asarray(b["window_nll"])
        iv = _interval(diff, boot)
        r["vs_baseline"] = {
            "baseline": baseline,
            "nll_diff": float(diff.mean()),
            "nll_diff_ci": None if iv is None else iv.model_dump(),
            "ppl_ratio": math.exp(float(diff.mean())),
            "ppl_ratio_ci": _exp(iv),
        }


class _WindowTally:
    """Perplexity's running figure: the window just scored (``gali 128 tok, window 3: ppl
    12.34``), also handed to ``on_step``."""

    def __init__(self, on_step: Callable[[str], None] | None) -> None:
        self.on_step = on_step
        self.last = ""

    def add(self, record: dict) -> str:
        length = _length(record["ratio"], record["train_window"])
        ppl = _ppl(record["nll"], record["tokens"])
        self.last = f"{record['method']} {length} tok, window {record['window']}: ppl {ppl:.2f}"
        if self.on_step is not None:
            self.on_step(self.last)
        return self.last

    def status(self) -> str:
        return self.last


def _length(ratio: float, big_l: int) -> int:
    """The length ``ratio * L`` in tokens (at least 2: one predicted token)."""
    return max(2, int(ratio * big_l))


@dataclass(eq=False)
class PplRun(RunKind):
    """Perplexity as a run kind (:func:`ragfix.eval.run.run`): its cells are the (method,
    length, window) of the run, each scored on its method's own backend. The driver loads the
    first method's (``config.backend_ref``), whose tokenizer reads the text and whose weights,
    chat template and tokenizer the folder is bound to (every method runs on the same weights);
    each other method with a window left to score is loaded in turn, the one before freed first.
    The summary is the result of :func:`run_ppl`."""

    config: PplConfig
    variants: list[Variant]
    ratios: Sequence[float]
    windows: range
    data: Path
    baseline: str | None
    on_step: Callable[[str], None] | None
    unit = "window"
    label = "perplexity"

    def __post_init__(self) -> None:
        self.text = read_texts(self.data)  # a bad file: refused before any model is loaded

    def folder(self, out: Path) -> RunFolder:
        return ppl_folder(out, self.config)

    def setup(self, backend) -> None:
        """Tokenize the text with ``backend`` (every method shares the model, so its tokenizer).

        Raises:
            DataError: the text is too short for the windows at the longest length.
        """
        self.backend, c, windows = backend, self.config, self.windows
        longest = _length(max(self.ratios), c.train_window or trained_window(backend))
        # ~4 characters per token in English prose: tokenize a generous prefix only
        self.tokens = backend.tokenize(self.text[: windows.stop * longest * 12])
        if len(self.tokens) < windows.stop * longest:
            raise DataError(
                self.data,
                None,
                None,
                f"{len(self.tokens)} tokens, need {windows.stop} x {longest} for windows "
                f"{windows.start}:{windows.stop}",
            )

    def bind(self, folder: RunFolder, restart: bool) -> None:
        ident = self.backend.identity()  # what every method shares: weights, tokenizer
        folder.bind({k: ident[k] for k in ("model", "chat_template", "tokenizer")}, restart)

    def cells(self) -> list[tuple[str, tuple[Variant, float, int]]]:
        return [
            (_window_id(self.config, v, r, k), (v, r, k))
            for v in self.variants
            for r in self.ratios
            for k in self.windows
        ]

    def compute(self, todo: list[tuple[Variant, float, int]], store, batch_size: int) -> None:
        first, self.backend = self.backend, None
        for variant, group in itertools.groupby(todo, key=lambda cell: cell[0]):
            if variant is not self.variants[0]:
                first = None
                gc.collect()  # the previous method's model is freed before the next loads
            ref = self.config.backend_ref.model_copy(
                update={"name": variant.backend, "options": variant.options}
            )
            backend = first if variant is self.variants[0] else ref.load(shared=False)
            big_l = self.config.train_window or trained_window(backend)
            resolved = backend.identity()["options"]
            longest = _length(max(self.ratios), big_l)
            for _, ratio, k in group:
                window = self.tokens[k * longest : k * longest + _length(ratio, big_l)]
                store(
                    {
                        "cell_id": _window_id(self.config, variant, ratio, k),
                        "method": variant.label,
                        "ratio": ratio,
                        "window": k,
                        "train_window": big_l,
                        "options": resolved,
                        **window_stats(*score_window(backend, window)),
                    }
                )
            del backend
        gc.collect()

    def tally(self, finished: list[dict]) -> _WindowTally:
        return _WindowTally(self.on_step)

    def summarize(self, folder: RunFolder | None, records: list[dict]) -> dict:
        c, windows = self.config, self.windows
        by_id = {r["cell_id"]: r for r in records}
        rows = []
        for variant in self.variants:
            for ratio in self.ratios:
                stats = [by_id[_window_id(c, variant, ratio, k)] for k in windows]
                big_l = stats[0]["train_window"]
                rows.append(
                    {
                        "method": variant.label,
                        "backend": variant.backend,
                        "ratio": ratio,
                        "length": _length(ratio, big_l),
                        "windows": [windows.start, windows.stop],
                        **length_stats(stats),
                        "vs_baseline": None,
                        "train_window": big_l,
                        "options": stats[0]["options"],
                    }
                )
        if self.baseline is not None:
            paired_with(rows, self.baseline)
        return {
            "kind": PPL_KIND,
            "model": c.model,
            "data": self.data.name,
            "train_window": rows[0]["train_window"],
            "ratios": list(self.ratios),
            "windows": [windows.start, windows.stop],
            "window_tokens": max(r["length"] for r in rows),
            "baseline": self.baseline,
            "bootstrap": WINDOW_BOOTSTRAP.model_dump(),
            "rows": rows,
        }


def run_ppl(
    data: str | Path,
    model: str = "smollm2",
    train_window: int | None = None,
    ratios: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0),
    methods: tuple[str, ...] = ("vanilla", "gali", "linear", "dynamic", "yarn", "truncated"),
    windows: range = range(2),
    gali_options: dict | None = None,
    gali_grid: dict[str, list] | None = None,
    baseline: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    out: str | Path | None = None,
    restart: bool = False,
    shard: str | Shard | None = None,
    on_step: Callable[[str], None] | None = None,
    console: Console | None = None,
) -> dict:
    """Perplexity of each method at each length ``ratio * L`` on the text windows ``windows``.

    Args:
        data: JSON Lines file of long texts (field ``text``).
        model: model name (see :func:`ragfix.models.load_model`).
        train_window: ``L`` (default: the model's ``max_position_embeddings``); GALI and the RoPE
            baselines extend it to ``max(ratios) * L`` (rope ``factor = max(ratios)``).
        ratios: lengths as multiples of ``L``.
        methods: keys of :data:`METHODS`.
        windows: the text windows read (``range(3, 13)``: windows 3 to 12), the same for every
            method and length.
        gali_options, gali_grid: see :func:`method_variants`.
        baseline: the label the other methods are paired with (default: ``vanilla`` when it is
            among the methods, else no pairing).
        out: a run folder (:func:`ppl_folder`): each (method, length, window) is stored as it is
            scored and reused by a rerun (more windows or methods resume; another model file,
            data content, ``train_window`` or ``ratios`` is refused); ``None``: nothing stored.
        shard: compute one job's part of the run only, ``"i/N"`` or a
            :class:`~ragfix.eval.shard.Shard` (0-based): its own result file in ``out``, its
            manifest, no summary (it returns a :class:`~ragfix.eval.run.ShardDone`); join the
            shards with :func:`~ragfix.eval.merge.merge_runs`.
        restart: start ``out`` over when it holds a run of other settings, weights or data.
        on_step: called with a short status after each (method, length, window) this call
            scores (``gali 128 tok, window 3: ppl 12.34``).
        console: where the "resuming:" line and the progress bar go (``None``: quiet).

    Returns:
        the result (``kind`` ``ragfix-ppl``, rendered by the ``ppl`` table kind): ``model``,
        ``data``, ``train_window``, ``windows`` ``[start, stop]``, ``window_tokens``,
        ``baseline``, ``bootstrap`` and ``rows``, one per (method label, ratio): ``method``,
        ``backend``, ``ratio``, ``length``, ``windows``, the figures of :func:`length_stats`,
        ``vs_baseline``, ``train_window``, ``options``.

    Raises:
        ConfigError: unknown method, bad grid, bad window range, no positive ratio, or a
            baseline that is not among the methods.
        pydantic.ValidationError: an invalid backend option.
        DataError: bad data file, or the text is too short for the windows.
        ConfigMismatchError: ``out`` holds a run of other settings, weights or data content
            (not with ``restart``).
        Interrupted: Ctrl-C, once every window scored before it is stored; its message says how
            many this run stored and where.
    """
    if not ratios or min(ratios) <= 0:
        raise ConfigError(f"ratios {list(ratios)}: give one or more positive multiples of L")
    if windows.step != 1 or windows.start < 0 or not windows:
        raise ConfigError(f"windows {windows}: give a non-empty range from 0 on, step 1")
    variants = method_variants(
        methods,
        train_window=train_window,
        max_ratio=max(ratios),
        gali_options=gali_options,
        gali_grid=gali_grid,
    )
    labels = [v.label for v in variants]
    if baseline is None and "vanilla" in labels:
        baseline = "vanilla"
    if baseline is not None and baseline not in labels:
        raise ConfigError(f"baseline {baseline!r} is not among the methods ({', '.join(labels)})")
    config = PplConfig(
        data=str(Path(data).resolve()),
        model=model,
        train_window=train_window,
        ratios=list(ratios),
        inputs=input_fingerprints(data=data),
        backend_ref=BackendRef(
            name=variants[0].backend,
            model=model,
            options=variants[0].options,
            device=device,
            dtype=dtype,
        ),
    )
    kind = PplRun(config, variants, ratios, windows, Path(data), baseline, on_step)
    return run(
        kind, config.backend_ref, out, restart=restart, shard=Shard.parse(shard), console=console
    )


def plot_ppl(result: dict, path: str | Path) -> None:
    """Perplexity against length per method (log y, 95% intervals as error bars), with the
    window marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["length"], r["ppl"], r["ppl_ci"]) for r in rows if r["method"] == m)
        ys = [p[1] for p in pts]
        err = [
            [y - (ci["low"] if ci else y) for _, y, ci in pts],
            [(ci["high"] if ci else y) - y for _, y, ci in pts],
        ]
        ax.errorbar([p[0] for p in pts], ys, yerr=err, marker="o", capsize=3, label=m)
    ax.axvline(result["train_window"], color="grey", ls="--", lw=1, label="trained window L")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity by length")
    ax.legend(fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict, out: str | Path) -> dict[str, Path]:
    """Write ``ppl.json`` (the result; copy it under ``results/`` to render it with the ``ppl``
    table kind), ``ppl.md`` (its tables) and ``ppl.png`` into ``out``."""
    out = Path(out)
    paths = {"json": out / "ppl.json", "md": out / "ppl.md", "png": out / "ppl.png"}
    atomic_write_json(paths["json"], result)
    atomic_write_text(paths["md"], markdown_tables(ppl_tables(result)) + "\n")
    plot_ppl(result, paths["png"])
    return paths
