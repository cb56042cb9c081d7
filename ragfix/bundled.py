"""Small real data samples shipped inside the package (see ``ragfix/data/README.md``).

``ragfix eval nq-sample`` and ``ragfix eval kv-sample`` resolve to these files, ``--corpus demo``
and ``--questions demo`` to the pipeline demo corpus. The files are found through
``importlib.resources`` (``files("ragfix") / "data"``), so they resolve inside an installed wheel
as well as in a source checkout; they are declared as package data in ``pyproject.toml``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from ragfix.errors import DataError

#: the folder of the bundled files (a real directory: ragfix is installed unzipped)
DATA_DIR = Path(str(files("ragfix") / "data"))

#: name -> file in ragfix/data (Lost-in-the-Middle samples for ``ragfix eval NAME``)
BUNDLED = {
    "nq-sample": "nq_10docs_sample.jsonl.gz",
    "kv-sample": "kv_16pairs_sample.jsonl.gz",
}
#: the pipeline demo: a JSONL corpus of 400 NQ passages and its 400 questions
DEMO_CORPUS = DATA_DIR / "nq_demo_corpus.jsonl"
DEMO_QUESTIONS = DATA_DIR / "nq_demo_questions.jsonl"


def bundled_path(name: str) -> Path | None:
    """The bundled file called ``name`` (a key of :data:`BUNDLED`), or None."""
    return DATA_DIR / BUNDLED[name] if name in BUNDLED else None


def resolve_data(data: str | Path) -> Path:
    """A bundled sample name (``nq-sample``, ``kv-sample``) or a path of a file that exists.

    Raises:
        DataError: neither a bundled name nor an existing file.
    """
    path = bundled_path(str(data)) or Path(data)
    if not path.exists():
        raise DataError(path, None, None, "file not found")
    return path
