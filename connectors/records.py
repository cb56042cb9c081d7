"""Record ranges of a data file: ``"START:END"`` parsed, formatted and applied to loaded samples.

Record ``i`` is the record on line ``i + 1`` of its file, so a range names the same records
whether or not some of them are invalid or skipped: choices made on one range (a tune range) and
figures reported on a disjoint one never share a record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, TypeVar

from pydantic import AfterValidator

from ragfix.errors import ConfigError

if TYPE_CHECKING:
    from ragfix.connectors.corpus import QuestionRecord
    from ragfix.types import JudgePair, QASample

#: what a record range selects from: items that know their ``"file:line"`` (samples, judge
#: pairs) or their ``line`` (a pipeline's question records)
_Sourced = TypeVar("_Sourced", "QASample", "JudgePair", "QuestionRecord")


def parse_records(spec: str) -> slice:
    """A record range ``"START:END"`` (0-based, END excluded; either may be left out: ``"200:"``,
    ``":100"``) as a slice.

    Raises:
        ConfigError: not ``START:END`` with integers ``0 <= START < END``.
    """
    start, sep, stop = spec.strip().partition(":")
    try:
        a = int(start) if start.strip() else 0
        b = int(stop) if stop.strip() else None
    except ValueError:
        a = b = -1
    if not sep or a < 0 or (b is not None and b <= a):
        raise ConfigError(
            f"--records {spec!r}: expected START:END with 0 <= START < END "
            "(0-based record indices, END excluded), e.g. 0:200"
        )
    return slice(a, b)


def format_records(records: slice) -> str:
    """The canonical text of a record range (``slice(0, 200)`` -> ``"0:200"``)."""
    return f"{records.start or 0}:{'' if records.stop is None else records.stop}"


def canonical_records(spec: str | None) -> str | None:
    """``spec`` as :func:`format_records` writes it (``" 0:200 "`` -> ``"0:200"``); ``None`` (every
    record) as it is.

    Raises:
        ConfigError: not a record range (:func:`parse_records`).
    """
    return None if spec is None else format_records(parse_records(spec))


#: a run configuration's record range field: canonical, validated when the configuration is built
RecordRange = Annotated[str | None, AfterValidator(canonical_records)]


def select_records(samples: list[_Sourced], records: slice | None) -> list[_Sourced]:
    """The samples (judge pairs, question records) read from the records of ``records``
    (record ``i`` is on line ``i + 1`` of its file: a question record's ``line``, else the end
    of the item's ``source`` = ``"file:line"``), in file order; all when ``None``."""
    if records is None:
        return samples
    lo, hi = records.start or 0, records.stop
    out = []
    for s in samples:
        line = getattr(s, "line", None) or int(s.source.rsplit(":", 1)[1])
        index = line - 1
        if lo <= index and (hi is None or index < hi):
            out.append(s)
    return out
