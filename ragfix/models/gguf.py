"""GGUF files: their content fingerprint, a check that transformers can read them, and their
conversion (once, dequantized) into a safetensors checkpoint in the ragfix cache."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from ragfix.errors import ModelLoadError
from ragfix.fingerprint import content_fingerprint
from ragfix.io import cache_dir


def gguf_fingerprint(gguf: str | Path) -> str:
    """The content fingerprint (:func:`content_fingerprint`) of a GGUF file: any change of the
    file (even one keeping its name and size) gives a new value.

    Raises:
        OSError: the file does not exist or cannot be read.
    """
    return content_fingerprint(gguf)


def converted_dir(gguf: str | Path) -> Path:
    """Cache folder of the safetensors conversion of a GGUF file, keyed by the file's content
    (:func:`gguf_fingerprint`): two files with the same name and size never share a cache."""
    g = Path(gguf)
    return cache_dir() / "models" / f"{g.stem}-{gguf_fingerprint(g)}"


def check_gguf(gguf: str | Path) -> None:
    """Refuse a GGUF file that cannot be converted, with one line naming the file.

    Raises:
        ModelLoadError: not a GGUF file (bad magic), an incomplete file, or an architecture the
            installed transformers cannot read (the supported ones are listed).
    """
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    g = Path(gguf)
    with open(g, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{g}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(g))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ModelLoadError(
            f"{g}: not a complete GGUF file ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f'{g}: GGUF architecture "{arch}" is not supported by the installed transformers '
            f"(supported: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )


def ensure_converted(gguf: str | Path) -> Path:
    """Dequantize ``gguf`` once into a safetensors checkpoint in the cache; return its folder.

    The conversion is written to a temporary folder and renamed into place, so an interrupted
    conversion never leaves a half-written cache. Takes ~20 s for SmolLM2 on a CPU.

    Raises:
        ModelLoadError: see :func:`check_gguf`.
    """
    target = converted_dir(gguf)
    if (target / "config.json").exists():
        return target
    check_gguf(gguf)
    print(
        f"ragfix: preparing {Path(gguf).name} once (dequantizing to safetensors, ~20 s for "
        f"SmolLM2; ~{4 * Path(gguf).stat().st_size // 2**20} MB cache at {target.parent})",
        file=sys.stderr,
        flush=True,
    )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    g = Path(gguf)
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(g.parent), gguf_file=g.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # a non-empty target: another process (a test worker) won the race
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
