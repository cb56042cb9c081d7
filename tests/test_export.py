"""``ragfix export``: a LoRA adapter as a merged checkpoint, a GGUF LoRA and a vLLM recipe.

The merged checkpoint is compared with peft's unmerged adapter; the GGUF file is read back with
the ``gguf`` reader and its ``s B A`` set against peft's merged weights, the q/k rows put back
from llama.cpp's order by an index computation of their own (no runtime of llama.cpp here:
docs/pos2distill.md gives the check with llama.cpp itself)."""

import json
import re

import pytest
import torch
from conftest import ROOT, tiny_folder
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.errors import AdapterError, ConfigError
from ragfix.export import export_gguf_lora, export_merged, vllm_recipe

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(base, out, rank: int = 4, alpha: int = 8, **config):
    """A seeded LoRA with non-zero A and B (peft's ``init_lora_weights=False``) on every
    projection of the tiny model in ``base``, saved as a peft folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, **config)
    peft_model = get_peft_model(model, lora)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:  # B starts at zero even so: give both a real value
            param.data = torch.randn_like(param) * 0.1
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    base = tiny_folder(d / "base")
    return base, _adapter(base, d / "adapter")


def _merged_deltas(base, merged) -> dict[str, torch.Tensor]:
    """``{module: merged weight - base weight}`` of every LoRA target (peft's merge)."""
    from safetensors.torch import load_file

    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(merged / "model.safetensors"))
    return {
        k.removesuffix(".weight"): after[k] - before[k]
        for k in before
        if k.endswith(".weight") and k.rsplit(".", 2)[-2] in TARGETS
    }


def _from_llama_cpp_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k rows back in Hugging Face order, index by index: its row ``h*d + 2*i + j``
    holds Hugging Face's row ``h*d + j*d/2 + i`` (head h, rotary half j, index i)."""
    d = w.shape[0] // n_head
    out = torch.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            for j in range(2):
                out[h * d + j * (d // 2) + i] = w[h * d + 2 * i + j]
    return out


def _gguf_deltas(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The file's fields and ``{llama.cpp tensor: alpha / r * B A}``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {}
    for key in ("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha"):
        f = reader.fields[key]
        value = f.parts[f.data[0]]
        fields[key] = bytes(value).decode() if value.dtype == "uint8" else float(value[0])
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    deltas = {}
    for name, a in tensors.items():
        if name.endswith(".lora_a"):
            b = tensors[name.replace(".lora_a", ".lora_b")]
            deltas[name.removesuffix(".weight.lora_a")] = (
                fields["adapter.lora.alpha"] / a.shape[0] * b @ a
            )
    return fields, deltas


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _check_gguf(base, adapter, tmp_path, arch, permuted):
    merged = export_merged(adapter, str(base), tmp_path / "merged")
    assert merged["max_abs_logit_diff"] < 1e-4
    info = export_gguf_lora(adapter, str(base), tmp_path / "lora.gguf")
    assert info["architecture"] == arch and info["tensors"] == 2 * len(TARGETS) * 2
    fields, deltas = _gguf_deltas(tmp_path / "lora.gguf")
    assert fields == {
        "general.architecture": arch,
        "general.type": "adapter",
        "adapter.type": "lora",
        "adapter.lora.alpha": 8.0,
    }
    peft = _merged_deltas(base, tmp_path / "merged")
    assert len(deltas) == len(peft) == 2 * len(TARGETS)
    heads = {"attn_q": 4, "attn_k": 2}  # the tiny config's query and KV heads
    for module, want in peft.items():
        layer, rest = module.removeprefix("model.layers.").split(".", 1)
        name = GGUF_NAMES[rest]
        got = deltas[f"blk.{layer}.{name}"]
        if permuted and name in heads:
            assert not torch.allclose(got, want, atol=1e-5)  # the rows are moved ...
            got = _from_llama_cpp_rows(got, heads[name])  # ... and put back
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_llama_lora_exports_merged_and_as_gguf_with_llama_cpp_q_k_rows(llama, tmp_path):
    base, adapter = llama
    _check_gguf(base, adapter, tmp_path, "llama", permuted=True)


def test_qwen2_lora_exports_as_gguf_in_hugging_face_row_order(tmp_path):
    base = tiny_folder(tmp_path / "base", arch="qwen2")
    adapter = _adapter(base, tmp_path / "adapter")
    _check_gguf(base, adapter, tmp_path, "qwen2", permuted=False)


def test_vllm_recipe_checks_the_adapter_as_vllm_reads_it(llama, tmp_path):
    base, adapter = llama
    recipe = vllm_recipe(adapter, "HuggingFaceTB/SmolLM2-135M-Instruct", "pos2distill")
    assert recipe["max_lora_rank"] == 8  # the smallest --max-lora-rank vLLM takes above r = 4
    assert recipe["scale"] == 2.0 and recipe["target_modules"] == sorted(TARGETS)
    assert recipe["command"] == (
        "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --enable-lora --lora-modules "
        f"pos2distill={adapter.resolve()} --max-lora-rank 8"
    )
    # what vLLM refuses is refused here, each reason named
    for change, reason in [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head'] (vLLM supports none)"),
        ({"use_dora": True}, "DoRA"),
        ({"r": 1024}, "rank 1024 above vLLM's largest --max-lora-rank, 512"),
    ]:
        bad = tmp_path / reason.split()[0]
        bad.mkdir()
        for f in adapter.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        config = json.loads((adapter / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(AdapterError, match=re.escape(f"vLLM would refuse it: {reason}")):
            vllm_recipe(bad, "base")
        if change.get("use_dora"):
            with pytest.raises(AdapterError, match="DoRA adapter; llama.cpp applies plain"):
                export_gguf_lora(bad, str(base), tmp_path / "x.gguf")
            assert not (tmp_path / "x.gguf").exists()


def test_an_architecture_without_a_gguf_mapping_is_refused(llama, tmp_path):
    _, adapter = llama
    phi3 = tmp_path / "phi3"
    phi3.mkdir()
    config = json.loads((llama[0] / "config.json").read_text())
    (phi3 / "config.json").write_text(json.dumps({**config, "architectures": ["Phi3ForCausalLM"]}))
    with pytest.raises(ConfigError, match="a Phi3ForCausalLM; GGUF LoRA export maps"):
        export_gguf_lora(adapter, str(phi3), tmp_path / "x.gguf")


def test_cli_export_writes_all_three_and_the_report(llama, tmp_path):
    base, adapter = llama
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["export", str(adapter), "--model", str(base), "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "export.json").read_text())
    assert report["merged"]["max_abs_logit_diff"] < 1e-4
    assert report["gguf_lora"]["tensors"] == 28 and (out / "lora.gguf").is_file()
    assert report["vllm"]["command"].startswith(f"vllm serve {base} --enable-lora")
    assert (out / "merged" / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    res = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "not a LoRA adapter folder" in res.output


def test_channel_scaling_folds_into_q_and_k_columns_as_the_every_row_variant(llama, tmp_path):
    from safetensors.torch import load_file

    from ragfix.export import fold_channel_scaling

    base, adapter = llama
    folded = fold_channel_scaling(str(base), tmp_path / "folded", channel=5, layers=[1], factor=-1)
    assert folded["scaling"] == {"channel": 5, "layers": [1], "factor": -1.0, "source": "options"}
    # the runtime patch scaling every row's query is the same model; its default (the last
    # token's query only) is another variant
    assert folded["max_abs_logit_diff_all_rows"] < 1e-5
    assert folded["max_abs_logit_diff_last_row_variant"] > 1e-3
    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(tmp_path / "folded" / "model.safetensors"))
    for key, w in before.items():
        if key in (
            "model.layers.1.self_attn.q_proj.weight",
            "model.layers.1.self_attn.k_proj.weight",
        ):
            torch.testing.assert_close(after[key][:, 5], -w[:, 5])
            after[key][:, 5] = w[:, 5]
        torch.testing.assert_close(after[key], w, rtol=0, atol=0)  # nothing else changed
    res = CliRunner().invoke(
        app, ["export", str(adapter), "--backend-opt", "channel=5", "--out", str(tmp_path / "x")]
    )
    assert res.exit_code == 2 and "give an adapter or a channel scaling, not both" in res.output


def test_merged_gguf_is_the_base_gguf_plus_the_lora_as_transformers_reads_it(tmp_path):
    """The committed SmolLM2 adapter merged into SmolLM2's GGUF (Q4_1), merged tensors in F16,
    read back by transformers' GGUF loader (its own dequantization and its own undoing of
    llama.cpp's q/k row order): each target weight is the base weight ragfix loads plus peft's
    ``s B A`` within F16 rounding; what the adapter does not touch is the base's."""
    from transformers import AutoModelForCausalLM

    from ragfix.export import _lora_pairs, export_merged_gguf, lora_scale
    from ragfix.models.load import load_model

    adapter = ROOT / "adapters" / "smollm2-kv8-r1"
    info = export_merged_gguf(adapter, "smollm2", tmp_path / "merged.gguf")
    assert (info["tensor_type"], info["merged_tensors"]) == ("f16", 210)
    merged = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="merged.gguf", dtype=torch.float32
    )
    base, _ = load_model("smollm2", device="cpu", dtype="float32")
    scale = lora_scale(json.loads((adapter / "adapter_config.json").read_text()))
    pairs = _lora_pairs(adapter)
    for layer in (0, 17, 29):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
            module = f"model.layers.{layer}.{proj}"
            a, b = pairs[module]
            before = base.get_submodule(module).weight
            after = merged.get_submodule(module).weight
            delta = scale * (b @ a)
            # the change the file holds is the adapter's within F16 rounding (about .01-.11 of
            # it here): leaving the change out would be 1.0, a wrong q/k row order about 1.4
            off = (after - before - delta).norm() / delta.norm()
            assert off < 0.2, (module, float(off))
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert torch.equal(merged.model.norm.weight, base.model.norm.weight)


def test_cli_export_refuses_an_unknown_merged_type_before_writing(llama, tmp_path):
    _, adapter = llama
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app, ["export", str(adapter), "--merged-type", "q4_1", "--out", str(out)]
    )
    assert res.exit_code == 2 and "--merged-type q4_1: one of f32, f16, q8_0" in res.output
    assert not out.exists()
