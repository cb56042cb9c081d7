"""JSON Lines reading with errors that name the file, the line and the field.

Every reader in ragfix goes through :func:`read_jsonl`, so one malformed record either stops the
run with a one-line error (``file:line: field: what is wrong``) or, with ``skip_invalid``, is
skipped and counted while the other records are kept.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

from ragfix.errors import DataError


class SkipCounter:
    """Counts records skipped with ``skip_invalid`` and keeps the first few errors to show."""

    def __init__(self) -> None:
        self.count = 0
        self.examples: list[str] = []

    def add(self, err: DataError) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(str(err))


def skip_or_raise(err: DataError, skip_invalid: bool, skipped: SkipCounter | None) -> None:
    """The one policy for a bad record: raise ``err``, or, with ``skip_invalid``, count it in
    ``skipped`` (when given) so the caller can move on to the next record.

    Raises:
        DataError: ``err``, when ``skip_invalid`` is false.
    """
    if not skip_invalid:
        raise err from None
    if skipped is not None:
        skipped.add(err)


def open_text(path: str | Path) -> io.TextIOBase:
    """Open a plain or gzip (``.gz``) text file as UTF-8.

    Raises:
        DataError: the file does not exist or is not readable.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(p, None, None, "file not found")
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8")
    return open(p, encoding="utf-8")


def read_jsonl(
    path: str | Path, skip_invalid: bool = False, skipped: SkipCounter | None = None
) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, record)`` for every JSON object line (1-based; blank lines skipped).

    Raises:
        DataError: a line is not a JSON object (unless ``skip_invalid``, which counts it in
            ``skipped`` instead), or the file cannot be read / decoded.
    """
    try:
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise DataError(path, n, None, "not a JSON object")
                except (json.JSONDecodeError, DataError) as e:
                    err = (
                        e
                        if isinstance(e, DataError)
                        else DataError(
                            path, n, None, f"malformed JSON ({e.msg} at column {e.colno})"
                        )
                    )
                    skip_or_raise(err, skip_invalid, skipped)
                    continue
                yield n, rec
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(path, None, None, f"cannot read file ({e})") from None


def require(rec: dict, field: str, kind: type | tuple[type, ...], path, line: int):
    """``rec[field]`` checked to be of ``kind`` and non-empty.

    Raises:
        DataError: the field is missing, of the wrong type, or empty.
    """
    if field not in rec:
        raise DataError(path, line, field, "missing")
    val = rec[field]
    if not isinstance(val, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataError(path, line, field, f"expected {names}, got {type(val).__name__}")
    if val in ("", [], {}):
        raise DataError(path, line, field, "empty")
    return val
