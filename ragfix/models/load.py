"""Loading a model and its tokenizer, and what identifies a loaded model's weights: the files it
was loaded from or, once a tensor changes, the tensors themselves (:func:`model_identity`)."""

from __future__ import annotations

import hashlib

import torch

from ragfix.errors import ModelNotFoundError
from ragfix.fingerprint import content_fingerprint, weight_files_fingerprint
from ragfix.models.device import (
    cpu_threads,
    default_attention,
    layer_windows,
    resolve_device,
    resolve_dtype,
    slides,
)
from ragfix.models.resolve import SMOLLM2, ModelSpec, checkpoint_dir, resolve_model


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
        name: see :mod:`ragfix.models.resolve`.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...; on the CPU torch's thread
            count is set by :func:`cpu_threads`.
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on CPU) or a torch dtype / its name.
        attn_implementation: passed to transformers (``"eager"`` when a method needs
            attention weights); by default :func:`~ragfix.models.device.default_attention`'s
            (``"sdpa"``; on the CPU, banded SDPA for a model with sliding-window layers, SDPA
            with float32 decode steps for another bf16 or fp16 model:
            :mod:`ragfix.models.attention`).

    Returns:
        ``(model, tokenizer)``; the tokenizer pads on the left and has a pad token.

    Raises:
        ModelNotFoundError: the name cannot be resolved or the hub cannot be reached.
        ConfigError: an invalid ``$RAGFIX_THREADS``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    import ragfix.models.attention  # noqa: F401  (registers ragfix's SDPA forms with transformers)

    dev = resolve_device(device)
    if dev.type == "cpu":
        cpu_threads()
    tok, where = _tokenizer_at(name)
    the_dtype = resolve_dtype(dtype, dev)
    try:
        config = AutoConfig.from_pretrained(where)
        sliding = slides(layer_windows(config))
        attention = attn_implementation or default_attention(dev, the_dtype, sliding)
        model = AutoModelForCausalLM.from_pretrained(
            where, config=config, dtype=the_dtype, attn_implementation=attention
        )
    except OSError as e:
        raise ModelNotFoundError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from e
    model.to(dev).eval()
    spec = resolve_model(name)
    model.ragfix_name = spec.name
    files = checkpoint_files_fingerprint(spec)
    note_weights(model, f"files:{files}" if files else None)
    return model, tok


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
