"""Atomic file writes and the append-only JSON Lines store used by every resumable run.

* :func:`atomic_write_text` / :func:`atomic_write_json`: write to a temporary file in the same
  folder, fsync, then ``os.replace`` — a reader sees the old file or the new one, never half.
* :class:`JsonlStore`: one JSON object a line, each appended with flush + fsync, keyed by a field
  (e.g. ``cell_id``). Reading tolerates a torn last line (a crash mid-write) and keeps the first
  record of a key, so reruns and merged shards never double-count.
* :func:`cache_dir`: the ragfix cache folder (converted models, content fingerprints, indexes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from ragfix.errors import DataError

#: the settings file of every run folder (sweep, pipeline sweep, judge)
CONFIG_FILE = "config.json"


def cache_dir() -> Path:
    """The ragfix cache folder: ``$RAGFIX_CACHE`` if set, else the platform's user cache dir."""
    env = os.environ.get("RAGFIX_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ragfix"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_fingerprint(path: str | Path) -> str:
    """First 16 hex digits of the SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (UTF-8); parent folders are created."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj) -> None:
    """``obj`` as indented JSON, written atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary file beside ``path`` to write (by any writer, by name) that replaces
    ``path`` when the block ends without an error, and is removed when it raises; parent
    folders are created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A temporary folder beside ``path`` to fill that takes ``path``'s place (an older folder
    there removed) when the block ends without an error, and is removed when it raises: a
    folder at ``path`` is always whole."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp"))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; give the usual folder mode
    try:
        yield tmp
        if p.exists():
            shutil.rmtree(p)
        tmp.rename(p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class JsonlStore:
    """Append-only JSON Lines file of records keyed by ``key``.

    Args:
        path: the file this process appends to (created on first append).
        key: the field that identifies a record (``"cell_id"``).
        read_also: more files to read (other ranks' shards); never written.
    """

    def __init__(self, path: str | Path, key: str = "cell_id", read_also: Iterable[Path] = ()):
        self.path = Path(path)
        self.key = key
        self.read_also = [Path(p) for p in read_also]
        self.torn_lines = 0

    def _read_file(self, path: Path, into: dict[str, dict]) -> None:
        if not path.exists():
            return
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    self.torn_lines += 1  # a crash mid-write: the cell is simply redone
                    continue
                if isinstance(rec, dict) and self.key in rec:
                    into.setdefault(rec[self.key], rec)

    def load(self) -> dict[str, dict]:
        """All records of all files, first record per key wins, in file order."""
        out: dict[str, dict] = {}
        self.torn_lines = 0
        for p in [self.path, *self.read_also]:
            self._read_file(p, out)
        return out

    def append(self, record: dict) -> None:
        """Append one record (one line), flushed and fsynced before returning.

        A torn last line left by a crash is terminated first so the new record starts clean.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


def read_run_config(out: str | Path) -> dict | None:
    """The stored ``config.json`` of a run folder, or ``None`` when there is none yet.

    Raises:
        DataError: the file is not readable JSON.
    """
    path = Path(out) / CONFIG_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(path, None, None, f"unreadable run configuration ({e})") from None
