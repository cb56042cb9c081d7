"""The tables of a perplexity result (``ragfix eval-ppl``'s ``ppl.json``)."""

from __future__ import annotations

from ragfix.tables import TableSpec

#: ``"kind"`` of a perplexity result file (``ragfix eval-ppl``, :func:`ragfix.eval.ppl.run_ppl`)
PPL_KIND = "ragfix-ppl"


def _ppl_cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _ppl_ci(iv: dict | None, digits: int = 2) -> str:
    return "n/a" if iv is None else f"[{iv['low']:.{digits}f}, {iv['high']:.{digits}f}]"


def ppl_tables(result: dict) -> list[TableSpec]:
    """The tables of a perplexity result (:func:`ragfix.eval.ppl.run_ppl`, ``ppl.json``).

    Two tables, one row per (method, length): perplexity with its 95% interval over windows, over
    the last quarter of each window, and the ratio to the baseline's perplexity with its paired
    interval (when the result has a baseline); then perplexity by query kind (tokens predicted
    from a query at an interpolated vs a whole-number position ID) with the token counts. A line
    under them says what the windows and intervals are.
    """
    rows = result["rows"]
    base = result.get("baseline")
    headers = ["method", "length", "x L", "ppl", "95% CI", "last quarter"]
    if base:
        headers += [f"ppl / {base}", "95% CI (paired)"]
    main, kinds = [], []
    for r in rows:
        cells = [
            r["method"],
            str(r["length"]),
            f"{r['ratio']:g}",
            _ppl_cell(r["ppl"]),
            _ppl_ci(r["ppl_ci"]),
            _ppl_cell(r["ppl_tail"]),
        ]
        if base:
            vs = r.get("vs_baseline")
            cells += (
                [f"{vs['ppl_ratio']:.3f}", _ppl_ci(vs["ppl_ratio_ci"], 3)] if vs else ["—", "—"]
            )
        main.append(cells)
        kinds.append(
            [
                r["method"],
                str(r["length"]),
                str(r["tokens_interp"]),
                _ppl_cell(r["ppl_interp"]),
                str(r["tokens_whole"]),
                _ppl_cell(r["ppl_whole"]),
            ]
        )
    start, stop = result["windows"]
    boot = result["bootstrap"]
    line = (
        f"{result['model']}, L = {result['train_window']}, {stop - start} text windows "
        f"({start} to {stop - 1}) of {result['window_tokens']} tokens from {result['data']}, "
        f"length tokens read from each. 95% intervals: {boot['method']} bootstrap "
        f"over windows ({boot['resamples']} resamples, seed {boot['seed']}) of the mean NLL per "
        "token, exponentiated"
        + (f"; ppl / {base}: exp of the mean per-window NLL difference, paired." if base else ".")
    )
    kind_headers = [
        "method",
        "length",
        "tokens from interpolated queries",
        "ppl",
        "tokens from whole-number queries",
        "ppl",
    ]
    return [
        TableSpec("Perplexity by length", headers, main),
        TableSpec(
            "Perplexity by query position ID (tokens summed over windows)",
            kind_headers,
            kinds,
            [line],
        ),
    ]
