"""Render the result tables of Markdown files from the committed result files.

Every figure in the README and ``docs/`` comes from a file under ``results/`` (a run's
``summary.json`` copied there, or a comparison written by ``ragfix report RUN... --json
results/NAME.json``). In the Markdown, a table is a block between two markers::

    <!-- results:KIND PATH -->
    (generated: do not edit by hand)
    <!-- /results -->

``PATH`` is the result file, relative to the Markdown file's folder (``results/kv8.json`` in the
README, ``../results/kv8.json`` in ``docs/``). ``KIND`` is a table kind of
:func:`ragfix.eval.results.result_tables`: ``curve`` (per-position accuracy with Wilson
intervals; a ``summary.json`` or a comparison), ``references`` (closed-book and oracle, and the
worst position against the oracle), ``merit`` (mean, worst position and gap with 95%
intervals), ``paired`` (per-position differences, McNemar p, the notes on runs not paired) or
``comparison`` (all of them); ``references``, ``merit`` and ``paired`` need a comparison file.
``benchmark`` renders a benchmark's file (:func:`ragfix.eval.results.write_benchmark`), ``ppl`` a
perplexity result (``ragfix eval-ppl``'s ``ppl.json``) and ``judge`` a judge run's
``summary.json`` (``ragfix judge``, also ``--from-judgments``:
:func:`ragfix.judge.report.judge_tables`), each only its own kind of file. Markers inside fenced
code blocks are left alone.

Commands::

    ragfix render README.md docs/*.md            # rewrite the blocks from results/
    ragfix render --check README.md docs/*.md    # exit 1 when a block is out of date
"""

from __future__ import annotations

import re
from pathlib import Path

from ragfix.errors import DataError
from ragfix.eval.results import TABLE_KINDS, load_result, result_tables
from ragfix.io import atomic_write_text
from ragfix.tables import markdown_tables

_MARKER = re.compile(
    r"<!--\s*(?:results:(?P<kind>[\w-]+)\s+(?P<path>\S+)|(?P<close>/results))\s*-->"
)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?(?:^ {0,3}\1[ \t]*$|\Z)", re.M | re.S)


def render_text(text: str, base: Path, source: Path | None = None) -> str:
    """``text`` with every results block rewritten from its result file.

    Args:
        text: a Markdown document.
        base: the folder result paths are relative to (the document's folder).
        source: the document, for error messages.

    Raises:
        DataError: a block without its closing marker, a closing marker without a block, a
            nested block, an unknown table kind, or a result file that cannot be read.
    """
    fences = [m.span() for m in _FENCE.finditer(text)]
    out, pos, opener = [], 0, None
    for m in _MARKER.finditer(text):
        if any(a <= m.start() < b for a, b in fences):
            continue
        line = text.count("\n", 0, m.start()) + 1
        if m.group("close") is None:
            if opener is not None:
                raise DataError(source, line, None, "results block opened inside another one")
            opener = (m, line)
            continue
        if opener is None:
            raise DataError(source, line, None, "<!-- /results --> without an opening marker")
        start, start_line = opener
        if start.group("kind") not in TABLE_KINDS:
            kinds = ", ".join(TABLE_KINDS)
            raise DataError(
                source, start_line, None, f"unknown table kind {start.group('kind')!r} ({kinds})"
            )
        result = load_result(base / start.group("path"))
        body = markdown_tables(result_tables(result, start.group("kind")))
        out += [text[pos : start.end()], f"\n\n{body}\n\n"]
        pos, opener = m.start(), None
    if opener is not None:
        raise DataError(source, opener[1], None, "results block without <!-- /results -->")
    return "".join(out) + text[pos:]


def render_files(paths: list[str | Path], check: bool = False) -> list[Path]:
    """Render the results blocks of Markdown files.

    Args:
        paths: Markdown files.
        check: only compare, write nothing.

    Returns:
        The files that are out of date (with ``check=False``: the files rewritten).

    Raises:
        DataError: see :func:`render_text`; a file that cannot be read.
    """
    stale = []
    for p in map(Path, paths):
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise DataError(p, None, None, f"cannot read ({e.strerror})") from None
        new = render_text(text, p.parent, p)
        if new != text:
            stale.append(p)
            if not check:
                atomic_write_text(p, new)
    return stale
