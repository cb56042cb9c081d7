"""The channel-scaled backend (arXiv 2406.02536): the attention patch against a direct reference
computation on tiny seeded models, its cache semantics, padding, options and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from pydantic import ValidationError

from ragfix.backends import load_backend
from ragfix.backends.channel_scaling import (
    PRESETS,
    ChannelScalingBackend,
    apply_channel_scaling,
    default_layers,
    parse_layers,
)
from ragfix.backends.patching import attention_modules
from ragfix.errors import IncompatibleMethodsError, UnsupportedModelError

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
IMPLS = ["eager", "sdpa"]


def _ids(seed: int = 0, batch: int = 2, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=g)


def _capture_inputs(model, layer: int):
    """Record the attention input and RoPE (cos, sin) of one layer during a forward."""
    seen = {}

    def hook(_mod, _args, kwargs):
        seen["h"] = kwargs["hidden_states"]
        seen["pe"] = kwargs["position_embeddings"]

    return seen, attention_modules(model)[layer].register_forward_pre_hook(hook, with_kwargs=True)


def _reference_rows(attn, h, pe, channel, factor, rows):
    """The method written out directly: channel scaled in the attention input (not the rank-1
    form), full projections, RoPE, grouped-query heads repeated, bottom-right causal softmax over
    the last ``rows`` queries. Returns the pre-``o_proj`` output rows ``[B, rows, H * hd]``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    hs = h.clone()
    hs[..., channel] *= factor
    b, t, _ = h.shape

    def heads(x, norm=None):
        x = x.view(b, t, -1, attn.head_dim)
        return (norm(x) if norm is not None else x).transpose(1, 2)

    q = heads(attn.q_proj(hs), getattr(attn, "q_norm", None))
    k = heads(attn.k_proj(hs), getattr(attn, "k_norm", None))
    v = heads(attn.v_proj(h))
    q, k = apply_rotary_pos_emb(q, k, *pe)
    k, v = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
    scores = q[:, :, -rows:] @ k.transpose(2, 3) * attn.head_dim**-0.5
    causal = torch.arange(t)[None, :] <= torch.arange(t - rows, t)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(b, rows, -1)


@pytest.mark.parametrize("attn", IMPLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_factor_one_is_vanilla(arch, attn):
    m = tiny_model(arch, seed=1, attn=attn)
    ids = _ids()
    with torch.no_grad():
        ref = m(input_ids=ids).logits
        with apply_channel_scaling(m, channel=5, layers=[0, 1], factor=1.0):
            got = m(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", IMPLS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("rows", [1, 3])
def test_patched_attention_equals_reference(arch, attn, rows):
    m = tiny_model(arch, seed=2, attn=attn)
    layer, channel, factor = 1, 7, -1.0
    ids = _ids(seed=3)
    attn_mod = attention_modules(m)[layer]
    seen, hook = _capture_inputs(m, layer)
    outs = {}
    o_hook = attn_mod.o_proj.register_forward_pre_hook(
        lambda _m, args: outs.__setitem__("x", args[0])
    )
    try:
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)
            vanilla_rows = outs["x"]
            with apply_channel_scaling(m, channel, [layer], factor, rows=rows):
                m(input_ids=ids, use_cache=False)
            ref = _reference_rows(attn_mod, seen["h"], seen["pe"], channel, factor, rows)
    finally:
        hook.remove()
        o_hook.remove()
    got = outs["x"]
    torch.testing.assert_close(got[:, -rows:], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, :-rows], vanilla_rows[:, :-rows], rtol=0, atol=0)
    assert (got[:, -rows:] - vanilla_rows[:, -rows:]).abs().max() > 1e-4


@pytest.mark.parametrize("attn", IMPLS)
def test_only_last_row_changes_at_prefill(attn):
    m = tiny_model("llama", seed=4, attn=attn)
    ids = _ids(seed=5)
    with torch.no_grad():
        ref = m(input_ids=ids).logits
        with apply_channel_scaling(m, channel=3, layers=[0, 1], factor=0.0):
            got = m(input_ids=ids).logits
    torch.testing.assert_close(got[:, :-1], ref[:, :-1], rtol=0, atol=0)
    assert (got[:, -1] - ref[:, -1]).abs().max() > 1e-4


@pytest.mark.parametrize("attn", IMPLS)
def test_cache_holds_scaled_keys_and_decode_matches_teacher_forcing(attn):
    m = tiny_model("qwen2", seed=6, attn=attn)
    layer, channel, factor = 1, 11, -0.5
    ids = _ids(seed=7)
    seen, hook = _capture_inputs(m, layer)
    try:
        with torch.no_grad():
            plain = m(input_ids=ids[:, :-1], use_cache=True).cache
            with apply_channel_scaling(m, channel, [layer], factor) as cs:
                pre = m(input_ids=ids[:, :-1], use_cache=True)
                h, pe = seen["h"], seen["pe"]
                step = m(input_ids=ids[:, -1:], cache=pre.cache).logits[:, -1]
                with cs.rows(2):
                    forced = m(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
    attn_mod = attention_modules(m)[layer]
    hs = h.clone()
    hs[..., channel] *= factor
    k = attn_mod.k_proj(hs).view(*hs.shape[:2], -1, attn_mod.head_dim).transpose(1, 2)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    _, k = apply_rotary_pos_emb(k, k, *pe)
    n = k.shape[2]  # the prompt's entries (the decode step appended one more)
    cached = pre.cache.layers[layer]
    torch.testing.assert_close(cached.keys[:, :, :n], k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached.values[:, :, :n], plain.layers[layer].values)
    assert (cached.keys[:, :, :n] - plain.layers[layer].keys).abs().max() > 1e-3
    # layer 0 is not scaled: its cache holds the normal keys
    torch.testing.assert_close(pre.cache.layers[0].keys[:, :, :n], plain.layers[0].keys)
    # decoding over the cache = teacher forcing with the last two rows scaled
    torch.testing.assert_close(step, forced[:, -1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pre.logits[:, -1], forced[:, -2], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attn", IMPLS)
def test_left_padded_batch_matches_single_prompts(attn):
    m = tiny_model("mistral", seed=8, attn=attn)
    a, b = _ids(seed=9, batch=1, length=12)[0], _ids(seed=10, batch=1, length=7)[0]
    batch = torch.stack([a, torch.cat([torch.zeros(5, dtype=torch.long), b])])
    mask = torch.stack([torch.ones(12), torch.cat([torch.zeros(5), torch.ones(7)])]).long()
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), apply_channel_scaling(m, channel=2, layers=[0, 1], factor=-1.0):
        together = m(input_ids=batch, attention_mask=mask).logits[:, -1]
        alone = [m(input_ids=x[None]).logits[0, -1] for x in (a, b)]
        gen = m.generate(input_ids=batch, attention_mask=mask, **kw)[:, 12:]
        gen_b = m.generate(input_ids=b[None], attention_mask=torch.ones(1, 7).long(), **kw)
    torch.testing.assert_close(together, torch.stack(alone), rtol=1e-4, atol=1e-4)
    assert gen[1].tolist() == gen_b[0, 7:].tolist()


def test_gemma_attention_is_supported():
    from transformers import AutoModelForCausalLM, GemmaConfig

    torch.manual_seed(0)
    cfg = GemmaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    m = AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids()
    with torch.no_grad():
        ref = m(input_ids=ids).logits
        with apply_channel_scaling(m, channel=1, layers=[1], factor=1.0):
            same = m(input_ids=ids).logits
        with apply_channel_scaling(m, channel=1, layers=[1], factor=-1.0):
            moved = m(input_ids=ids).logits
    torch.testing.assert_close(same, ref, rtol=1e-5, atol=1e-5)
    assert (moved[:, -1] - ref[:, -1]).abs().max() > 1e-4


def test_patch_is_reversible_and_refuses_bad_input():
    m = tiny_model("llama", seed=11)
    ids = _ids()
    with torch.no_grad():
        ref = m(input_ids=ids).logits
        cs = apply_channel_scaling(m, channel=4, layers=[1], factor=0.0)
        with pytest.raises(IncompatibleMethodsError, match="already patched by channel-scaled"):
            apply_channel_scaling(m, channel=4, layers=[1], factor=0.0)
        cs.remove()
        torch.testing.assert_close(m(input_ids=ids).logits, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="channel 64 out of range"):
        apply_channel_scaling(m, channel=64, layers=[0], factor=0.0)
    with pytest.raises(ValueError, match="out of range"):
        apply_channel_scaling(m, channel=1, layers=[2], factor=0.0)


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import AutoModelForCausalLM, GPT2Config

    m = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    msg = r"channel-scaled does not support gpt2 \(gpt2\): .*llama, mistral, qwen2, qwen3, gemma"
    with pytest.raises(UnsupportedModelError, match=msg):
        apply_channel_scaling(m, channel=0, layers=[0], factor=0.0)


def test_chunked_prefill_over_cache_is_refused():
    m = tiny_model("llama", seed=12)
    ids = _ids()
    with torch.no_grad(), apply_channel_scaling(m, channel=1, layers=[0], factor=0.0):
        pre = m(input_ids=ids[:, :6], use_cache=True)
        with pytest.raises(RuntimeError, match="non-empty KV cache"):
            m(input_ids=ids[:, 6:], cache=pre.cache)


def test_layers_parsing_and_defaults():
    assert parse_layers("10-12,3") == [3, 10, 11, 12]
    assert parse_layers([5, 2, 5]) == [2, 5]
    assert parse_layers(7) == [7]
    with pytest.raises(ValueError, match="expected e.g."):
        parse_layers("a-b")
    assert default_layers(32) == list(range(10, 26))
    assert default_layers(30) == list(range(9, 24))
    assert default_layers(2) == [1]
    assert PRESETS["llama-2-7b-chat"].channel == 2393
    assert PRESETS["llama-2-7b-chat"].factor == -1.0


def test_options_are_validated():
    opts = ChannelScalingBackend.options_model
    with pytest.raises(ValidationError, match="unknown preset"):
        opts(preset="gpt-5")
    with pytest.raises(ValidationError, match="either calibration or preset"):
        opts(preset="llama-2-7b-chat", calibration="x.json")
    with pytest.raises(ValidationError, match="needs a calibration file"):
        opts()
    assert opts(channel=3, layers="1-2").layers == [1, 2]


def test_real_smollm2(smol):
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    kw = {"max_new_tokens": 8, "stop_at_newline": False}
    base = [g.text for g in smol.generate(prompts, batch_size=2, **kw)]
    same = ChannelScalingBackend(smol.model, smol.tokenizer, channel=100, factor=1.0)
    try:
        assert same.identity()["scaling"]["layers"] == list(range(9, 24))
        assert [g.text for g in same.generate(prompts, batch_size=2, **kw)] == base
        assert not same.supports_prefix_reuse
        # asking for prefix reuse falls back to exact full prompts
        assert [g.text for g in same.generate(prompts, prefix_reuse=True, **kw)] == base
    finally:
        same.scaling.remove()
    moved = ChannelScalingBackend(smol.model, smol.tokenizer, channel=100, factor=-8.0)
    try:
        batched = [g.text for g in moved.generate(prompts, batch_size=2, **kw)]
        single = [moved.generate([p], **kw)[0].text for p in prompts]
        lp_moved = moved.next_token_logprobs(prompts[:1])[0]
    finally:
        moved.scaling.remove()
    assert batched == single
    assert (lp_moved - smol.next_token_logprobs(prompts[:1])[0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="preset 'llama-2-7b-chat' is for a model"):
        ChannelScalingBackend(smol.model, smol.tokenizer, preset="llama-2-7b-chat")


def test_load_backend_refuses_bad_options_before_loading():
    with pytest.raises(ValidationError, match="unknown preset"):
        load_backend("channel-scaled", model="/nonexistent/model", preset="nope")
