"""Small real data samples shipped inside the package (see ``ragfix/data/README.md``).

``ragfix eval nq-sample`` and ``ragfix eval kv-sample`` resolve to these files.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"

#: name -> file in ragfix/data
BUNDLED = {
    "nq-sample": "nq_10docs_sample.jsonl.gz",
    "kv-sample": "kv_16pairs_sample.jsonl.gz",
}


def bundled_path(name: str) -> Path | None:
    """The bundled file called ``name`` (``"nq-sample"``, ``"kv-sample"``), or None."""
    return DATA_DIR / BUNDLED[name] if name in BUNDLED else None
