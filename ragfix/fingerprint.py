"""Content fingerprints of files and folders: what identifies an input, a checkpoint's weight
files or a corpus by its bytes, not its path.

Each file's SHA-256 (:func:`ragfix.io.file_fingerprint`) is remembered in the ragfix cache
(:func:`ragfix.io.cache_dir`, :data:`FINGERPRINT_INDEX`) under its resolved path, size and
modification time, so an unchanged file is read once. Imports neither torch nor transformers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

from ragfix.io import cache_dir

#: the JSON index, under :func:`cache_dir`, of remembered content fingerprints
FINGERPRINT_INDEX = "content-hashes.json"
#: a file modified less than this long ago (ns) is hashed but not remembered: a rewrite within
#: the file system's timestamp granularity would otherwise keep its size and modification time
RECENT_NS = 2 * 10**9


def _fingerprints(files: list[Path]) -> list[str]:
    """The content fingerprint (:func:`ragfix.io.file_fingerprint`) of each file, read from the
    index when the file's resolved path, size and ``mtime_ns`` are those remembered; the index is
    rewritten once, atomically, for the files hashed (an unwritable cache only costs the memory).

    Raises:
        OSError: a file does not exist or cannot be read.
    """
    from ragfix.io import atomic_write_json, file_fingerprint

    index_path = cache_dir() / FINGERPRINT_INDEX
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    out, changed = [], False
    for f in files:
        path = Path(f).resolve()
        st = path.stat()  # before reading: a change while hashing gives a new mtime next time
        key = str(path)
        entry = index.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("sha256"), str)
        ):
            out.append(entry["sha256"])
            continue
        digest = file_fingerprint(path)
        out.append(digest)
        if time.time_ns() - st.st_mtime_ns >= RECENT_NS:
            index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
            changed = True
    if changed:
        with contextlib.suppress(OSError):  # an unwritable cache: hashed again next time
            atomic_write_json(index_path, index)
    return out


def files_fingerprint(root: str | Path, files: list[Path]) -> str:
    """First 16 hex digits of the SHA-256 over the sorted names of ``files`` relative to
    ``root`` (POSIX form), each with its content fingerprint (remembered as
    :func:`content_fingerprint` does).

    Raises:
        ValueError: a file is not under ``root``.
        OSError: a file does not exist or cannot be read.
    """
    named = sorted((Path(f).relative_to(root).as_posix(), Path(f)) for f in files)
    digests = _fingerprints([f for _, f in named])
    h = hashlib.sha256()
    for (name, _), digest in zip(named, digests, strict=True):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()[:16]


def content_fingerprint(path: str | Path) -> str:
    """What identifies the content of a file or a folder: 16 hex digits.

    A file: the first 16 hex digits of the SHA-256 of its bytes. A folder: the first 16 hex
    digits of the SHA-256 over the sorted relative names of its files (in every subfolder) and
    their content fingerprints, so renaming, adding, removing or editing a file changes it.
    Names starting with ``.`` (files or folders) are left out; symbolic links to files are
    followed, links to folders are not.

    Each file's hash is remembered in ``<cache>/content-hashes.json`` under its resolved path,
    size and modification time (ns), so an unchanged file is read once; a file modified in the
    last :data:`RECENT_NS` is hashed on every call.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        OSError: a file cannot be read.
    """
    p = Path(path)
    if not p.is_dir():
        return _fingerprints([p])[0]
    files = []
    for folder, dirs, names in os.walk(p):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(folder, n) for n in names if not n.startswith(".")]
    return files_fingerprint(p, [f for f in files if f.is_file()])


#: suffixes of the weight files of a checkpoint folder
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: files of a checkpoint folder that describe how its weight files are read
WEIGHT_INDEX_FILES = ("adapter_config.json", "config.json", "generation_config.json")
#: training state a trainer saves next to the weights (never loaded as weights)
TRAINING_STATE_FILES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


def is_weight_file(name: str) -> bool:
    """Whether a file of a checkpoint folder holds or indexes weights: ``*.safetensors``,
    ``*.bin``, ``*.pt``, ``*.pth`` (not a trainer's optimizer, scheduler, scaler, RNG or argument
    state), their ``*.index.json``, the model's ``config.json`` and ``generation_config.json``
    (RoPE settings, sizes) and a peft ``adapter_config.json``."""
    if name in TRAINING_STATE_FILES or name.startswith("rng_state"):
        return False
    return name.endswith((*WEIGHT_SUFFIXES, ".index.json")) or name in WEIGHT_INDEX_FILES


def weight_files_fingerprint(folder: str | Path) -> str | None:
    """Fingerprint over the weight files (:func:`is_weight_file`) directly in ``folder``: their
    sorted names and content fingerprints (remembered as :func:`content_fingerprint` does), or
    ``None`` when the folder holds none.

    Raises:
        OSError: the folder or a weight file cannot be read.
    """
    root = Path(folder)
    files = [f for f in root.iterdir() if is_weight_file(f.name) and f.is_file()]
    return files_fingerprint(root, files) if files else None
