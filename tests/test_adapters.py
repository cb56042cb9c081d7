"""Adapters as a load option of every backend, and the attention patch handle: an adapter under
channel scaling or GALI equals applying both by hand; an adapter that does not attach or belongs to
other weights is refused; two attention patches are refused, never silently stacked."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file

from ragfix.backends import load_backend
from ragfix.backends.channel_scaling import ChannelScalingBackend, apply_channel_scaling
from ragfix.backends.gali import GaliBackend
from ragfix.errors import AdapterError, ConfigError, IncompatibleMethodsError
from ragfix.lora import METADATA_FILE, load_adapter
from ragfix.models.load import model_identity
from ragfix.prompts import TaskPrompt

PROMPT = TaskPrompt(user="Which river flows through Paris? Answer with one word.")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, smol):
    """A tiny seeded Llama with SmolLM2's tokenizer, saved as a local checkpoint folder."""
    d = tmp_path_factory.mktemp("tiny-base")
    m = tiny_model("llama", seed=3, attn="sdpa", vocab_size=len(smol.tokenizer))
    m.save_pretrained(d)
    smol.tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, base_dir):
    """A peft LoRA folder for the tiny base (q/v projections, non-zero B: it changes the model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    d = tmp_path_factory.mktemp("lora")
    get_peft_model(m, cfg).save_pretrained(d)
    return d


def _by_hand(base_dir, lora_dir):
    """The base model with the LoRA merged by peft directly."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa")
    return PeftModel.from_pretrained(m, str(lora_dir)).merge_and_unload().eval()


def _logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)


def test_adapter_changes_the_model_and_is_recorded(base_dir, lora_dir):
    plain = load_backend("vanilla", model=str(base_dir), device="cpu")
    adapted = load_backend("vanilla", model=str(base_dir), device="cpu", adapter=str(lora_dir))
    diff = (adapted.next_token_logprobs([PROMPT]) - plain.next_token_logprobs([PROMPT])).abs()
    assert diff.max() > 1e-3
    info = adapted.identity()["adapter"]
    assert info["path"] == str(lora_dir) and len(info["fingerprint"]) == 16
    assert "adapter" not in plain.identity()


def test_channel_scaling_with_adapter_equals_both_by_hand(base_dir, lora_dir):
    opts = {"channel": 5, "layers": [1], "factor": -1.0}
    b = load_backend(
        "channel-scaled", model=str(base_dir), device="cpu", adapter=str(lora_dir), **opts
    )
    hand = _by_hand(base_dir, lora_dir)
    ids = b.encode(PROMPT)
    with apply_channel_scaling(hand, 5, [1], -1.0):
        ref = _logprobs(hand, ids)
    torch.testing.assert_close(b.next_token_logprobs([PROMPT])[0], ref, rtol=1e-4, atol=1e-4)
    # and the scaling really acts on the adapted weights
    assert (ref - _logprobs(hand, ids)).abs().max() > 1e-4


def test_gali_with_adapter_equals_both_by_hand(base_dir, lora_dir, smol):
    opts = {"train_window": 16, "chunk_size": 6, "noise": False}
    b = load_backend("gali", model=str(base_dir), device="cpu", adapter=str(lora_dir), **opts)
    hand = GaliBackend(_by_hand(base_dir, lora_dir), smol.tokenizer, **opts)
    ids = b.encode(PROMPT)
    assert len(ids) > 16  # past the lowered window: GALI's own path
    torch.testing.assert_close(b.token_logprobs(ids), hand.token_logprobs(ids))


@pytest.mark.parametrize("name", ["attention-sort", "calibrated-attention", "pine", "set-based"])
def test_passage_backends_with_adapter_equal_the_method_on_the_merged_model(
    base_dir, lora_dir, smol, name
):
    """Each backend that reads a prompt's passages composes with an adapter: loaded with it, its
    next-token log-probs equal the same method built on the base with the LoRA merged by peft,
    and differ from the method without the adapter."""
    from ragfix.backends import backend_spec
    from ragfix.tasks import get_task
    from ragfix.types import Passage

    docs = [Passage(title=t, text=x) for t, x in [("A", "Paris is in France."), ("B", "Rome.")]]
    prompt = get_task("qa").prompt("Where is Paris?", docs)
    b = load_backend(name, model=str(base_dir), device="cpu", adapter=str(lora_dir))
    hand = backend_spec(name).resolve()(_by_hand(base_dir, lora_dir), smol.tokenizer)
    plain = load_backend(name, model=str(base_dir), device="cpu")
    got = b.next_token_logprobs([prompt])[0]
    torch.testing.assert_close(got, hand.next_token_logprobs([prompt])[0], rtol=1e-4, atol=1e-4)
    assert (got - plain.next_token_logprobs([prompt])[0]).abs().max() > 1e-3
    assert b.identity()["adapter"]["path"] == str(lora_dir)


def test_adapter_whose_tensors_do_not_attach_is_refused(base_dir, lora_dir, tmp_path):
    # case 26: tensor names saved from a differently named model; peft only warns
    bad = tmp_path / "renamed"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((lora_dir / "adapter_config.json").read_text())
    sd = load_file(str(lora_dir / "adapter_model.safetensors"))
    renamed = {k.replace("self_attn", "attention"): v for k, v in sd.items()}
    save_file(renamed, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=rf"0 of {len(sd)} LoRA tensors attach"):
        load_backend("vanilla", model=str(base_dir), device="cpu", adapter=str(bad))


def test_adapter_for_other_weights_is_refused(base_dir, lora_dir, tmp_path, smol):
    other = tiny_model("llama", seed=4, attn="sdpa", vocab_size=len(smol.tokenizer))
    meta = {"format": "ragfix-pos2distill", "kind": "lora", "base_model": model_identity(other)}
    d = tmp_path / "meta"
    d.mkdir()
    for f in lora_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / METADATA_FILE).write_text(json.dumps(meta))
    from transformers import AutoModelForCausalLM

    with pytest.raises(AdapterError, match="differing: fingerprint$"):
        load_adapter(AutoModelForCausalLM.from_pretrained(base_dir), d)
    with pytest.raises(AdapterError, match="not an adapter folder"):
        load_adapter(other, tmp_path / "nothing")


def test_pos2distill_needs_an_adapter():
    with pytest.raises(ConfigError, match="needs an adapter"):
        load_backend("pos2distill", model="/nonexistent/model")


def test_two_attention_patches_are_refused(base_dir, smol):
    b = load_backend("vanilla", model=str(base_dir), device="cpu")
    cs = ChannelScalingBackend(b.model, smol.tokenizer, channel=1, layers=[0], factor=0.0)
    gali = GaliBackend(b.model, smol.tokenizer, train_window=16, chunk_size=6)
    with pytest.raises(IncompatibleMethodsError, match="gali cannot be combined with channel"):
        gali.token_logprobs(b.encode(PROMPT))
    cs.scaling.remove()
    gali.token_logprobs(b.encode(PROMPT))  # alone it runs
    assert "_ragfix_attention_patch" not in b.model.get_decoder().layers[0].self_attn.__dict__
