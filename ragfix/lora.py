"""LoRA adapters as a load option of every backend: a LoRA (or full fine-tuning) artefact applied to
the base weights before a method's patches.

An adapter folder is either one written by ``ragfix distill`` (Pos2Distill, arXiv 2508.15709:
peft files plus ``ragfix_adapter.json`` naming the base model's weight fingerprint) or any peft
LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) for the same base model.

Loading refuses, with one line naming the folder, an adapter trained on other weights and an
adapter whose tensors do not all attach to the model (peft itself only warns, and a LoRA that
never attaches is the base model). Every applied adapter is identified by a fingerprint of its
weight file and its ``adapter_config.json`` (rank, alpha and target modules change the adapted
model too), which goes into the backend's identity and so into every run and cache key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ragfix.errors import AdapterError
from ragfix.fingerprint import files_fingerprint
from ragfix.models.load import model_identity, note_weights, weights_differ, weights_fingerprint

#: adapter metadata file written next to the peft adapter files by ``ragfix distill``
METADATA_FILE = "ragfix_adapter.json"
#: peft's LoRA settings (rank, alpha, target modules)
CONFIG_FILE = "adapter_config.json"
#: full fine-tuning weights (safetensors state dict of the whole model)
FULL_WEIGHTS_FILE = "model.safetensors"
#: peft's LoRA weight file
LORA_WEIGHTS_FILE = "adapter_model.safetensors"
#: the ``format`` field of :data:`METADATA_FILE`
FORMAT = "ragfix-pos2distill"
#: base-model fields that must match between the adapter's metadata and the loaded model
BASE_FIELDS = ("architecture", "hidden_size", "num_hidden_layers", "vocab_size", "fingerprint")


def read_metadata(adapter_dir: str | Path) -> dict | None:
    """The ``ragfix distill`` metadata of an adapter folder, or ``None`` for a plain peft folder.

    Raises:
        AdapterError: the folder does not exist, holds neither format, or its metadata is not
            of this format.
    """
    d = Path(adapter_dir)
    p = d / METADATA_FILE
    if not p.is_file():
        if (d / CONFIG_FILE).is_file():
            return None
        raise AdapterError(
            f"{adapter_dir}: not an adapter folder (no {METADATA_FILE} from `ragfix distill`, "
            "no peft adapter_config.json)"
        )
    try:
        meta = json.loads(p.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise AdapterError(f"{p}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if meta.get("format") != FORMAT:
        raise AdapterError(f"{p}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def check_base(meta: dict, model, where: str | Path) -> None:
    """Check that ``model`` is the base model the adapter was trained on.

    The fields of :data:`BASE_FIELDS` must be equal, and the ``weights`` fingerprints too when
    both the stored identity and the model's name weight files (``files:``).

    Raises:
        AdapterError: the identities differ (architecture, sizes or weight fingerprints).
    """
    want, have = meta["base_model"], model_identity(model)
    diff = [f for f in BASE_FIELDS if want.get(f) != have.get(f)]
    if weights_differ(want, have):
        diff.append("weights")
    if diff:
        raise AdapterError(
            f"{where}: adapter was trained on base model {want.get('name')!r} "
            f"({want.get('architecture')}, fingerprint {want.get('fingerprint')}), but the loaded "
            f"model is {have.get('name')!r} ({have.get('architecture')}, fingerprint "
            f"{have.get('fingerprint')}); differing: {', '.join(diff)}"
        )


def _attach_lora(model, adapter_dir: Path):
    """``model`` with the LoRA folder merged into its weights.

    Raises:
        AdapterError: a tensor of the file does not attach to any module of the model, or a
            LoRA module of the model gets no tensor from the file.
    """
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors import safe_open

    weights = adapter_dir / LORA_WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{adapter_dir}: no {LORA_WEIGHTS_FILE}")
    with safe_open(str(weights), framework="pt") as f:
        in_file = set(f.keys())
    peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    in_model = set(get_peft_model_state_dict(peft_model).keys())
    unmatched = sorted(in_file - in_model)
    empty = sorted(in_model - in_file)
    if unmatched or empty:
        attached = len(in_file & in_model)
        what = unmatched or empty
        raise AdapterError(
            f"{adapter_dir}: {attached} of {len(in_file)} LoRA tensors attach to the model "
            f"({len(unmatched)} match no module, {len(empty)} modules get no tensor; first: "
            f"{what[0]!r}); the adapter was saved from another model or module naming"
        )
    return peft_model.merge_and_unload(), weights


def load_adapter(model, adapter_dir: str | Path):
    """Apply an adapter folder to ``model``'s weights (LoRA merged, so every method's patches see
    the adapted projections and decoding runs at the base model's speed).

    Args:
        model: the base causal LM (``transformers``), as loaded by :func:`load_model`.
        adapter_dir: a ``ragfix distill`` folder or any peft LoRA folder for this base model.

    Returns:
        ``(model, info)``: the adapted model (eval mode) and ``info`` for the backend's identity:
        ``path``, ``fingerprint`` (:func:`adapter_fingerprint`), ``kind`` and, for ``ragfix
        distill`` folders, ``variant`` / ``steps`` / ``rows``. The adapted model's
        :func:`~ragfix.models.load.weights_fingerprint` is a ``files:`` value derived from the base
        model's and the adapter's when the base model was loaded from files, else the hash of its
        new tensors.

    Raises:
        AdapterError: see :func:`read_metadata`, :func:`check_base` and the attach check.
    """
    d = Path(adapter_dir)
    meta = read_metadata(d)
    if meta is not None:
        check_base(meta, model, d)
    base = weights_fingerprint(model) if getattr(model, "ragfix_weights", None) else None
    if meta is not None and meta.get("kind") == "full":
        from safetensors.torch import load_file

        weights = d / FULL_WEIGHTS_FILE
        missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            bad = (unexpected or missing)[:3]
            raise AdapterError(f"{d}: weights do not fit the model ({bad})")
    else:
        model, weights = _attach_lora(model, d)
    fingerprint = adapter_fingerprint(d, weights)
    if base is not None and base.startswith("files:"):
        derived = hashlib.sha256(f"{base}\0adapter:{fingerprint}".encode()).hexdigest()[:16]
        note_weights(model, f"files:{derived}")
    else:  # peft merges through .data, which the tensors' version counters do not see
        note_weights(model, None)
    info = {"path": str(d), "fingerprint": fingerprint, "kind": "lora"}
    if meta is not None:
        info.update({k: meta.get(k) for k in ("kind", "variant", "steps", "rows")})
    return model.eval(), info


def adapter_fingerprint(adapter_dir: str | Path, weights: str | Path) -> str:
    """What identifies an adapter folder's effect on a model: 16 hex digits over its weight file
    ``weights`` and, when present, its :data:`CONFIG_FILE` (names and content fingerprints, see
    :func:`ragfix.fingerprint.files_fingerprint`).

    Raises:
        OSError: a file cannot be read.
    """
    d = Path(adapter_dir)
    files = [Path(weights)] + ([d / CONFIG_FILE] if (d / CONFIG_FILE).is_file() else [])
    return files_fingerprint(d, files)


__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "FULL_WEIGHTS_FILE",
    "LORA_WEIGHTS_FILE",
    "METADATA_FILE",
    "adapter_fingerprint",
    "check_base",
    "load_adapter",
    "read_metadata",
]
