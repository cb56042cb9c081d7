"""JSON Lines reading with errors that name the file, the line and the field.

Every reader in ragfix goes through :func:`read_jsonl`, so one malformed record either stops the
run with a one-line error (``file:line: field: what is wrong``) or, with ``skip_invalid``, is
skipped and counted while the other records are kept. Files are read as editors write them: a
UTF-8 byte order mark is dropped and CRLF line ends are read as LF. A file that is not JSON Lines
at all (a JSON array, a CSV) is refused at its first line, naming the fields the reader wants.

Two records with the same identity must not become one result counted several times:
:class:`UniqueIds` gives each record of a file its own id, deterministically, and says so.
"""

from __future__ import annotations

import gzip
import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

from ragfix.errors import DataError

JSONL_HINT = "expected one JSON object per line (JSON Lines)"


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


def no_valid_records(path, skipped: SkipCounter | None, what: str = "records") -> DataError:
    """The error for a file left with nothing usable, naming the first skipped record's fault."""
    if skipped is not None and skipped.count:
        first = skipped.examples[0] if skipped.examples else ""
        detail = f"{skipped.count} skipped; first: {first}"
        return DataError(path, None, None, f"no valid {what} ({detail})")
    return DataError(path, None, None, f"no valid {what}")


def open_text(path: str | Path) -> io.TextIOBase:
    """Open a plain or gzip (``.gz``) text file as UTF-8; a byte order mark is dropped
    (``utf-8-sig``) and CRLF / CR line ends read as LF (universal newlines).

    Raises:
        DataError: the file does not exist or is not readable.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(p, None, None, "file not found")
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8-sig")
    return open(p, encoding="utf-8-sig")


def _not_jsonl(path, line: int, text: str, fields: str | None) -> DataError:
    """The whole-file error for a first line that cannot start a JSON Lines file."""
    start = text.lstrip()[:1]
    what = "a JSON array" if start == "[" else "not a JSON object"
    want = f" with fields {fields}" if fields else ""
    return DataError(path, line, None, f"{JSONL_HINT}{want}; this line is {what}")


def read_jsonl(
    path: str | Path,
    skip_invalid: bool = False,
    skipped: SkipCounter | None = None,
    fields: str | None = None,
) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, record)`` for every JSON object line (1-based, counting every line
    of the file; blank lines skipped).

    Args:
        path: a ``.jsonl`` or ``.jsonl.gz`` file (UTF-8, with or without a byte order mark,
            LF or CRLF line ends).
        skip_invalid: count malformed lines in ``skipped`` instead of stopping.
        fields: the fields the caller's format wants (e.g. ``"question, answers, ctxs[title,
            text, isgold]"``), named in the error for a file that is not JSON Lines.

    Raises:
        DataError: the first line is not a JSON object (a JSON array, a CSV header: the file is
            not JSON Lines; never skipped); a later line is not a JSON object (unless
            ``skip_invalid``, which counts it in ``skipped`` instead); the file cannot be read or
            decoded.
    """
    first = True
    try:
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                if first and not line.lstrip().startswith("{"):
                    raise _not_jsonl(path, n, line, fields)
                first = False
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    msg = f"malformed JSON ({e.msg} at column {e.colno}); {JSONL_HINT}"
                    skip_or_raise(DataError(path, n, None, msg), skip_invalid, skipped)
                    continue
                if not isinstance(rec, dict):
                    msg = f"{JSONL_HINT}, got a JSON {type(rec).__name__}"
                    skip_or_raise(DataError(path, n, None, msg), skip_invalid, skipped)
                    continue
                yield n, rec
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(path, None, None, f"cannot read file ({e})") from None


def require(rec: dict, field: str, kind: type | tuple[type, ...], path, line: int):
    """``rec[field]`` checked to be of ``kind`` and non-empty.

    A JSON boolean is never accepted where a number is wanted, and a string never where a
    boolean is (``"false"`` is not false).

    Raises:
        DataError: the field is missing, of the wrong type, or empty.
    """
    if field not in rec:
        raise DataError(path, line, field, "missing")
    val = rec[field]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(val, kinds) or (isinstance(val, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise DataError(path, line, field, f"expected {names}, got {json_type(val)}")
    if val in ("", [], {}):
        raise DataError(path, line, field, "empty")
    return val


def json_type(val) -> str:
    """How a value reads in the file: ``the string 'false'``, ``a number``, ``null``, ..."""
    if isinstance(val, str):
        return f"the string {val!r}"
    if val is None:
        return "null"
    if isinstance(val, bool):
        return "a boolean"
    if isinstance(val, int | float):
        return "a number"
    return {list: "a list", dict: "an object"}.get(type(val), type(val).__name__)


def require_bool(value, path, line: int, field: str, default: bool | None = None) -> bool:
    """A JSON boolean field; a missing one (``value is None``) is ``default``.

    Raises:
        DataError: the value is not ``true`` / ``false`` (e.g. the string ``"false"``, which
            Python would read as true), or it is missing and there is no default.
    """
    if value is None and default is not None:
        return default
    if not isinstance(value, bool):
        got = "missing" if value is None else json_type(value)
        raise DataError(path, line, field, f"expected true or false, got {got}")
    return value


class UniqueIds:
    """Gives each record of a file its own id, in file order (deterministic).

    The first record with an id keeps it; a later record with the same identity gets
    ``<id>#2``, ``<id>#3``, ... so that it is computed and counted as its own cell instead of
    sharing (and multiplying) the first record's result. :meth:`warn` then says which lines
    were renamed, in one line.

    Args:
        path: the file (for the message).
        what: what the ids identify, e.g. ``"sample"`` or ``"pair"``.
        identity: what makes two records the same, e.g. ``"question and gold passage"``.
    """

    def __init__(self, path, what: str, identity: str) -> None:
        self.path, self.what, self.identity = str(path), what, identity
        self.lines: dict[str, int] = {}
        self.renamed: list[str] = []

    def __call__(self, key: str, line: int) -> str:
        """The id of the record at ``line`` whose identity is ``key``."""
        if key not in self.lines:
            self.lines[key] = line
            return key
        k = 2
        while f"{key}#{k}" in self.lines:
            k += 1
        new = f"{key}#{k}"
        self.lines[new] = line
        self.renamed.append(
            f"line {line} has the {self.identity} of line {self.lines[key]} (now {self.what} "
            f"{new!r})"
        )
        return new

    def warn(self) -> None:
        """Warn (``UserWarning``, one line) when any id was made unique."""
        if self.renamed:
            more = f"; and {len(self.renamed) - 1} more" if len(self.renamed) > 1 else ""
            warnings.warn(
                f"{self.path}: {len(self.renamed)} duplicate {self.what}(s) kept as separate "
                f"{self.what}s, each counted once: {self.renamed[0]}{more}",
                stacklevel=3,
            )


def refuse_duplicate(seen: dict, key, path, line: int, field: str, what: str) -> None:
    """Record ``key`` as seen at ``line``; refuse it when an earlier line had it.

    Raises:
        DataError: ``key`` was already seen (the message names both lines).
    """
    if key in seen:
        raise DataError(path, line, field, f"duplicate {what} (also on line {seen[key]})")
    seen[key] = line
