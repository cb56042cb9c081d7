"""Adapters the serving engines load: a LoRA adapter folder (``ragfix distill``'s Pos2Distill or
any peft LoRA) exported as a merged checkpoint, a GGUF LoRA for llama.cpp and Ollama, and a vLLM
recipe.

- :func:`export_merged`: the base model with the LoRA merged into its weights (safetensors, the
  tokenizer beside it), loadable anywhere a Hugging Face checkpoint is. Its logits are compared
  with the adapter applied unmerged (peft's ``x W + s B A x``) on a probe text, and the largest
  difference is part of the result.
- :func:`export_gguf_lora`: the LoRA as a GGUF adapter file (``general.type = adapter``,
  ``adapter.type = lora``, ``adapter.lora.alpha``; each target module's ``lora_a`` [r, in] and
  ``lora_b`` [out, r], fp32, named as llama.cpp names the base tensor: ``blk.3.attn_q.weight``).
  llama.cpp stores the q and k projections of its ``llama`` architecture (Llama, Mistral,
  SmolLM2) with the rows of each head's rotary halves interleaved (its converter's permutation),
  so ``lora_b`` of q and k is permuted the same way; the other supported architectures (Qwen2,
  Qwen3, Gemma 3) keep Hugging Face's row order. ``llama-cli -m BASE.gguf --lora FILE``; Ollama:
  ``ADAPTER FILE`` in a Modelfile.
- :func:`fold_channel_scaling`: channel scaling (arXiv 2406.02536) as an edited checkpoint:
  scaling channel ``d`` of the attention input of q and k equals scaling column ``d`` of
  ``W_q`` and ``W_k`` in the chosen layers. Folded, it scales the queries of *every* token (the
  paper's "modify all tokens" variant), not only the last token's as the ``channel-scaled``
  backend does by default: a variant of its own, compared with the runtime patch on every row.
- :func:`vllm_recipe`: the checks vLLM's ``PEFTHelper`` applies when it reads
  ``adapter_config.json`` (no ``modules_to_save``, no DoRA, the rank within ``--max-lora-rank``),
  the target modules it can serve as LoRA on these families, and the command line
  (``vllm serve BASE --enable-lora --lora-modules NAME=PATH --max-lora-rank R``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ragfix.errors import AdapterError, ConfigError
from ragfix.io import atomic_dir, atomic_write_json
from ragfix.lora import CONFIG_FILE, LORA_WEIGHTS_FILE

#: Hugging Face architecture -> (llama.cpp architecture, whether q/k rows are permuted)
GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
    "Gemma3ForCausalLM": ("gemma3", False),
}
#: the projections vLLM serves as LoRA on the Llama, Mistral, Qwen and Gemma families (q/k/v
#: packed as qkv_proj, gate/up as gate_up_proj)
VLLM_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the values vLLM accepts for ``--max-lora-rank``
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: the text the merged checkpoint's logits are compared on (the adapter unmerged against merged)
PROBE = (
    "Extract the value corresponding to the specified key in the JSON object below. "
    '{"2a8d601d-1d69-4e64-9f90-8ad825a74195": "bb3ba2a5-7de8-434b-a86e-a88bb9fa7289"} Key: '
)


def _adapter_config(adapter_dir: Path) -> dict:
    """The adapter's ``adapter_config.json``.

    Raises:
        AdapterError: no LoRA folder (no config or weights), unreadable JSON, or a peft method
            that is not LoRA.
    """
    path = adapter_dir / CONFIG_FILE
    if not path.is_file() or not (adapter_dir / LORA_WEIGHTS_FILE).is_file():
        raise AdapterError(
            f"{adapter_dir}: not a LoRA adapter folder (needs {CONFIG_FILE} and "
            f"{LORA_WEIGHTS_FILE}); a full fine-tune is already a checkpoint"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r}: only LoRA exports")
    return config


def _lora_pairs(adapter_dir: Path) -> dict[str, tuple]:
    """``{module path: (A [r, in], B [out, r])}`` of the adapter's weight file (``model.layers.
    3.self_attn.q_proj``: peft's ``base_model.model.`` prefix removed).

    Raises:
        AdapterError: a tensor that is not a LoRA A/B weight (biases, embeddings, saved
            modules), or a module with only one of A and B.
    """
    from safetensors.torch import load_file

    pairs: dict[str, dict] = {}
    for key, tensor in load_file(str(adapter_dir / LORA_WEIGHTS_FILE)).items():
        name = key.removeprefix("base_model.model.")
        for part in ("A", "B"):
            if name.endswith(f".lora_{part}.weight"):
                pairs.setdefault(name.removesuffix(f".lora_{part}.weight"), {})[part] = tensor
                break
        else:
            raise AdapterError(
                f"{adapter_dir / LORA_WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight; "
                "only LoRA on linear layers exports"
            )
    for module, p in pairs.items():
        if set(p) != {"A", "B"}:
            raise AdapterError(f"{adapter_dir}: {module} has lora_{''.join(p)} only")
    return {m: (p["A"].float(), p["B"].float()) for m, p in sorted(pairs.items())}


def lora_scale(config: dict) -> float:
    """peft's scaling of ``B A``: ``lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``).

    Raises:
        AdapterError: per-module ranks or alphas (``rank_pattern`` / ``alpha_pattern``), which
            one GGUF alpha cannot state.
    """
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError("per-module ranks or alphas (rank_pattern, alpha_pattern) do not export")
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / r**0.5 if config.get("use_rslora") else alpha / r


def llama_cpp_row_order(weight, n_head: int):
    """The rows of a q or k projection ``[n_head * head_dim, ...]`` in llama.cpp's order for its
    ``llama`` architecture: within each head, the rows of the two rotary halves interleaved
    (head h, half j, index i at ``h*d + 2*i + j``)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _llama_cpp_lora(adapter_dir: Path, model: str) -> tuple[str, float, int, list[tuple]]:
    """The adapter as llama.cpp names and orders it: ``(llama.cpp architecture, peft's scale,
    rank, [(base tensor name "blk.3.attn_q", A [r, in], B [out, r])])``, B's rows in llama.cpp's
    q/k order where its architecture permutes them.

    Raises:
        AdapterError: see :func:`_adapter_config`, :func:`_lora_pairs`, :func:`lora_scale`; DoRA
            (llama.cpp applies plain LoRA only); a module llama.cpp has no tensor for.
        ConfigError: an architecture without a GGUF mapping here (:data:`GGUF_ARCHITECTURES`).
    """
    import gguf

    from ragfix.models.resolve import load_config

    config = _adapter_config(adapter_dir)
    if config.get("use_dora"):
        raise AdapterError(f"{adapter_dir}: a DoRA adapter; llama.cpp applies plain LoRA only")
    scale = lora_scale(config)
    base = load_config(model)
    arch = (base.architectures or ["?"])[0]
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{model}: a {arch}; GGUF LoRA export maps {', '.join(GGUF_ARCHITECTURES)}"
        )
    name, permuted = GGUF_ARCHITECTURES[arch]
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == name)
    names = gguf.TensorNameMap(enum, base.num_hidden_layers)
    heads = {"q_proj": base.num_attention_heads, "k_proj": base.num_key_value_heads}
    tensors = []
    for module, (a, b) in _lora_pairs(adapter_dir).items():
        target = names.get_name(module)
        if target is None:
            raise AdapterError(f"{adapter_dir}: {module} has no llama.cpp tensor for {arch}")
        last = module.rsplit(".", 1)[-1]
        if permuted and last in heads:
            b = llama_cpp_row_order(b, heads[last])
        tensors.append((target, a, b))
    return name, scale, config["r"], tensors


def export_gguf_lora(adapter_dir: str | Path, model: str, out_file: str | Path) -> dict:
    """Write the LoRA of ``adapter_dir`` as a GGUF adapter for the base model ``model``.

    Args:
        adapter_dir: a peft LoRA folder (``ragfix distill`` writes one).
        model: the base model (as for ``--model``): its configuration names the architecture,
            layer count and heads.
        out_file: the ``.gguf`` file to write (atomically).

    Returns:
        ``{"file", "architecture", "tensors", "alpha", "rank"}``.

    Raises:
        AdapterError, ConfigError: see :func:`_llama_cpp_lora`.
    """
    import gguf
    import numpy as np

    from ragfix.io import atomic_path

    adapter_dir, out_file = Path(adapter_dir), Path(out_file)
    name, scale, r, tensors = _llama_cpp_lora(adapter_dir, model)
    # llama.cpp reads alpha and divides by the rank it finds: state the scale peft applies
    alpha = scale * r
    with atomic_path(out_file) as tmp:
        writer = gguf.GGUFWriter(str(tmp), name)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for target, a, b in tensors:
            writer.add_tensor(f"{target}.weight.lora_a", np.ascontiguousarray(a.numpy()))
            writer.add_tensor(f"{target}.weight.lora_b", np.ascontiguousarray(b.numpy()))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {
        "file": str(out_file),
        "architecture": name,
        "tensors": 2 * len(tensors),
        "alpha": alpha,
        "rank": r,
    }


#: what the merged tensors of :func:`export_merged_gguf` may be stored as
MERGED_GGUF_TYPES = ("f32", "f16", "q8_0")


def export_merged_gguf(
    adapter_dir: str | Path,
    model: str,
    out_file: str | Path,
    *,
    base_gguf: str | Path | None = None,
    tensor_type: str = "f16",
) -> dict:
    """Write the base GGUF with the adapter merged into it: each LoRA target tensor dequantized,
    ``s B A`` added (q/k rows in llama.cpp's order) and stored as ``tensor_type``; every other
    tensor (embeddings, norms, untargeted layers) and every metadata field (tokenizer, chat
    template) copied as they are. Re-quantizing a merged tensor to a 4-bit type would bury the
    adapter's change in quantization error; quantize the file afterwards with
    ``llama-quantize`` if its size matters.

    Args:
        adapter_dir: a peft LoRA folder trained on ``model``.
        model: the base model as ragfix names it (its configuration names the architecture).
        out_file: the ``.gguf`` to write (atomically).
        base_gguf: the GGUF to merge into (default: ``model``'s own file when it is a GGUF).
        tensor_type: one of :data:`MERGED_GGUF_TYPES`.

    Returns:
        ``{"file", "base_gguf", "tensor_type", "merged_tensors", "copied_tensors"}``.

    Raises:
        AdapterError, ConfigError: see :func:`_llama_cpp_lora`; a model that is no GGUF and no
            ``base_gguf``; an unknown ``tensor_type``; a target tensor missing from the base or
            of another shape.
    """
    import gguf
    import numpy as np

    from ragfix.io import atomic_path
    from ragfix.models.resolve import resolve_model

    if tensor_type not in MERGED_GGUF_TYPES:
        raise ConfigError(f"tensor type {tensor_type!r}: one of {', '.join(MERGED_GGUF_TYPES)}")
    adapter_dir, out_file = Path(adapter_dir), Path(out_file)
    if base_gguf is None:
        spec = resolve_model(model)
        if spec.source != "gguf":
            raise ConfigError(f"{model} is not a GGUF: give the base GGUF to merge into")
        base_gguf = spec.path
    name, scale, _, lora = _llama_cpp_lora(adapter_dir, model)
    deltas = {f"{target}.weight": scale * (b @ a) for target, a, b in lora}
    reader = gguf.GGUFReader(str(base_gguf))
    missing = set(deltas) - {t.name for t in reader.tensors}
    if missing:
        raise ConfigError(f"{base_gguf}: no tensor {', '.join(sorted(missing))} to merge into")
    qtype = gguf.GGMLQuantizationType[tensor_type.upper()]
    written = {}  # the merged tensors, by name
    with atomic_path(out_file) as tmp:
        writer = gguf.GGUFWriter(str(tmp), name)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # written by the writer itself
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
        for t in reader.tensors:
            if t.name not in deltas:
                writer.add_tensor_info(
                    t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type
                )
                continue
            weight = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            delta = deltas[t.name].numpy()
            if weight.shape != delta.shape:
                raise ConfigError(
                    f"{base_gguf}: {t.name} is {list(weight.shape)}, the adapter's change "
                    f"{list(delta.shape)}: another base model"
                )
            merged = weight + delta
            if tensor_type == "f16":
                merged = merged.astype(np.float16)
            elif tensor_type == "q8_0":
                merged = gguf.quants.quantize(merged, qtype)
            written[t.name] = merged
            writer.add_tensor_info(t.name, merged.shape, merged.dtype, merged.nbytes, qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(written.get(t.name, t.data), tensor_endianess=reader.endianess)
        writer.close()
    return {
        "file": str(out_file),
        "base_gguf": str(base_gguf),
        "tensor_type": tensor_type,
        "merged_tensors": len(lora),
        "copied_tensors": len(reader.tensors) - len(lora),
    }


def export_merged(
    adapter_dir: str | Path, model: str, out: str | Path, *, device: str = "cpu"
) -> dict:
    """Write ``model`` with the adapter merged into its weights as a checkpoint folder
    (``model.safetensors``, ``config.json``, the tokenizer), fp32, and compare it with the
    adapter applied unmerged.

    Args:
        adapter_dir: a ``ragfix distill`` folder or a peft LoRA folder for ``model``.
        model: the base model (as for ``--model``; a GGUF base is dequantized, as ragfix loads
            it, so the checkpoint holds the weights ragfix measured).
        out: the folder to write.
        device: where the comparison runs.

    Returns:
        ``{"folder", "max_abs_logit_diff", "probe_tokens"}``: the largest absolute difference
        between the saved checkpoint's next-token logits and the unmerged adapter's over
        :data:`PROBE` (fp32; peft's merge adds ``s B A`` to each weight once).

    Raises:
        AdapterError: see :func:`ragfix.lora.load_adapter`.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ragfix.lora import check_base, load_adapter, read_metadata
    from ragfix.models.load import load_model

    adapter_dir, out = Path(adapter_dir), Path(out)
    _adapter_config(adapter_dir)
    meta = read_metadata(adapter_dir)
    base, tok = load_model(model, device=device, dtype="float32")
    if meta is not None:
        check_base(meta, base, adapter_dir)  # before peft attaches anything
    ids = tok(PROBE, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        unmerged = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        mine = unmerged(ids).logits
    merged, _ = load_adapter(unmerged.unload(), adapter_dir)  # the same base, LoRA layers out
    with atomic_dir(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    del merged, base, unmerged
    with torch.no_grad():
        saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
        theirs = saved(ids).logits
    return {
        "folder": str(out),
        "max_abs_logit_diff": float((theirs - mine).abs().max()),
        "probe_tokens": int(ids.shape[1]),
    }


def fold_channel_scaling(model: str, out: str | Path, *, device: str = "cpu", **options) -> dict:
    """Write ``model`` with channel scaling folded into its weights (column ``channel`` of
    ``q_proj`` and ``k_proj`` scaled by ``factor`` in the chosen layers) as a checkpoint folder,
    fp32, and compare it with the ``channel-scaled`` backend's runtime patch.

    Args:
        model: the model (as for ``--model``).
        out: the folder to write.
        device: where the comparison runs.
        options: the ``channel-scaled`` backend's options
            (:class:`~ragfix.backends.channel_scaling.options.ChannelScalingOptions`:
            ``calibration``, ``preset`` or ``channel`` / ``layers`` / ``factor``), resolved as the
            backend resolves them.

    Returns:
        ``{"folder", "scaling": {channel, layers, factor, source}, "max_abs_logit_diff_all_rows",
        "max_abs_logit_diff_last_row_variant", "probe_tokens"}``: the largest absolute
        difference of the folded checkpoint's logits over :data:`PROBE` from the runtime patch
        scaling every row (the same variant: rounding only) and from the patch's default, which
        scales the last row only (the two variants differ).

    Raises:
        ConfigError, pydantic.ValidationError: see the ``channel-scaled`` backend.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from ragfix.backends import load_backend
    from ragfix.backends.patching import attention_modules

    backend = load_backend("channel-scaled", model=model, device=device, dtype="float32", **options)
    state = backend.scaling.state
    scaling = {
        "channel": state.channel,
        "layers": list(state.layers),
        "factor": state.factor,
        "source": backend.source,
    }
    ids = backend.tokenizer(PROBE, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        with backend.scaling.rows(ids.shape[1]):
            every_row = backend.model(ids).logits
        last_row = backend.model(ids).logits
        backend.scaling.remove()
        mods = attention_modules(backend.model)
        for i in state.layers:
            for proj in (mods[i].q_proj, mods[i].k_proj):
                proj.weight[:, state.channel] *= state.factor
    with atomic_dir(out) as tmp:
        backend.model.save_pretrained(tmp, safe_serialization=True)
        backend.tokenizer.save_pretrained(tmp)
    del backend
    with torch.no_grad():
        folded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
        logits = folded(ids).logits
    return {
        "folder": str(out),
        "scaling": scaling,
        "max_abs_logit_diff_all_rows": float((logits - every_row).abs().max()),
        "max_abs_logit_diff_last_row_variant": float((logits - last_row).abs().max()),
        "probe_tokens": int(ids.shape[1]),
    }


def vllm_recipe(adapter_dir: str | Path, base_id: str, name: str = "ragfix") -> dict:
    """Check the adapter as vLLM reads it and give the command that serves it.

    vLLM's ``PEFTHelper.from_local_dir`` reads ``adapter_config.json`` (``r``, ``lora_alpha``,
    ``target_modules`` required) and refuses ``modules_to_save`` and DoRA; ``--max-lora-rank``
    must be at least ``r`` and one of :data:`VLLM_MAX_LORA_RANKS`; each LoRA tensor must belong
    to a module vLLM serves with LoRA (:data:`VLLM_LORA_MODULES` here).

    Args:
        adapter_dir: the adapter folder (vLLM loads it as it is).
        base_id: what ``vllm serve`` loads (a hub id or folder of the base model).
        name: the adapter's served name (requests ask for ``"model": name``).

    Returns:
        ``{"command", "max_lora_rank", "target_modules", "scale"}``.

    Raises:
        AdapterError: a field vLLM requires missing, ``modules_to_save``, DoRA, a rank above
            512, or a tensor of a module vLLM does not serve with LoRA (each named).
    """
    adapter_dir = Path(adapter_dir)
    config = _adapter_config(adapter_dir)
    problems = [f"{k} missing" for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']} (vLLM supports none)")
    if config.get("use_dora"):
        problems.append("DoRA (vLLM does not support it)")
    rank = config.get("r", 0)
    fits = [m for m in VLLM_MAX_LORA_RANKS if m >= rank]
    if not fits:
        problems.append(f"rank {rank} above vLLM's largest --max-lora-rank, 512")
    modules = sorted({m.rsplit(".", 1)[-1] for m in _lora_pairs(adapter_dir)})
    other = [m for m in modules if m not in VLLM_LORA_MODULES]
    if other:
        problems.append(f"LoRA on {', '.join(other)}, which vLLM does not serve with LoRA")
    if problems:
        raise AdapterError(f"{adapter_dir}: vLLM would refuse it: {'; '.join(problems)}")
    command = (
        f"vllm serve {base_id} --enable-lora --lora-modules {name}={adapter_dir.resolve()} "
        f"--max-lora-rank {fits[0]}"
    )
    return {
        "command": command,
        "max_lora_rank": fits[0],
        "target_modules": modules,
        "scale": lora_scale(config),
    }


def write_export_report(out: Path, report: dict) -> Path:
    """``export.json`` of an export folder (atomically): what was written and checked."""
    path = Path(out) / "export.json"
    atomic_write_json(path, report)
    return path


__all__ = [
    "GGUF_ARCHITECTURES",
    "PROBE",
    "MERGED_GGUF_TYPES",
    "export_gguf_lora",
    "export_merged",
    "export_merged_gguf",
    "fold_channel_scaling",
    "llama_cpp_row_order",
    "lora_scale",
    "vllm_recipe",
    "write_export_report",
]
