"""The ``calibrated-attention`` backend (Found in the Middle, arXiv 2406.16008, Sec. 4): every
calibrated layer against a by-hand computation (plain loops over heads and reader rows, the bias
measured by hand on the content-free prompt from the model's own eager attention) on tiny seeded
models of three architectures, over the prompt and a few greedy decoding steps; vanilla rows and
layers; the bias measured once per number of passages; a batch; the real SmolLM2 on real KV
data; refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import BUNDLED, tiny_model, wide_passages_prompt

from ragfix.backends import load_backend
from ragfix.backends.calibrated_attention import (
    PAPER_TEMPERATURE,
    CalibratedAttentionBackend,
    CalibratedAttentionOptions,
)
from ragfix.backends.hf import chat_text
from ragfix.backends.patching import attention_modules, patch_attention
from ragfix.connectors.litm import load_samples
from ragfix.errors import IncompatibleMethodsError, RagfixError
from ragfix.prompts import TaskPrompt
from ragfix.tasks import get_task, task_prompt
from ragfix.types import Passage

KV = BUNDLED / "kv_16pairs_sample.jsonl.gz"
DOCS = [
    Passage(title="Cats", text="Cats sleep a lot."),
    Passage(title="Berlin", text="Berlin is the capital of Germany."),
    Passage(title="Nile", text="The Nile is a river."),
]
PAIRS = [Passage(title=f"k{i}", text=f"v{i}{i}") for i in range(3)]


@pytest.fixture(scope="module")
def kv_samples():
    return load_samples(KV, 4, 2)


def _pieces(tokenizer, prompt: TaskPrompt):
    """Token ids of the chat text, per passage its token indices (a token goes where its first
    character is), and the readers: every token from the first one after the last passage."""
    text = chat_text(tokenizer, prompt)
    offset = text.find(prompt.user)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [a for a, _ in enc["offset_mapping"]]
    spans = [(offset + a, offset + b) for a, b in prompt.passages]
    members = [[t for t, c in enumerate(starts) if a <= c < b] for a, b in spans]
    first = min(t for t, c in enumerate(starts) if c >= spans[-1][1])
    return enc["input_ids"], members, first


def _by_hand_bias(model, tokenizer, prompt: TaskPrompt, layers) -> dict:
    """Per layer, head and passage of the content-free prompt: the attention summed over the
    passage's tokens, divided by its length, averaged over the readers (the model's own eager
    attention weights)."""
    ids, members, first = _pieces(tokenizer, prompt.no_content)
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    bias = {}
    for layer in layers:
        a = att[layer][0]
        per_head = []
        for h in range(a.shape[0]):
            row = []
            for tokens in members:
                total = 0.0
                for r in range(first, len(ids)):
                    total += float(a[h, r, tokens].sum()) / len(tokens)
                row.append(total / (len(ids) - first))
            per_head.append(row)
        bias[layer] = per_head
    return bias


def _by_hand_forward(attn, state, hidden_states, position_embeddings=None, **kwargs):
    """One layer over a whole sequence (batch 1): vanilla causal attention, then in a calibrated
    layer each reader row of each head rescaled passage by passage from the formulas."""
    members, first, bias, layers, temperature, heads_mode = state
    _, t, _ = hidden_states.shape
    shape = (1, t, -1, attn.head_dim)
    q = attn.q_proj(hidden_states).view(shape)
    k = attn.k_proj(hidden_states).view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [H, T, d], [Hkv, T, d]
    v = attn.v_proj(hidden_states).view(shape)[0].transpose(0, 1)
    cos, sin = position_embeddings

    def rope(x):
        a, b = x.chunk(2, dim=-1)
        return x * cos[0] + torch.cat((-b, a), dim=-1) * sin[0]

    q, k = rope(q), rope(k)
    heads, d = q.shape[0], q.shape[2]
    groups = heads // k.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    out = torch.zeros(t, heads, d)
    probs = []
    for h in range(heads):
        logits = (q[h] @ k[h // groups].T * attn.scaling).masked_fill(~causal, float("-inf"))
        probs.append(torch.softmax(logits, dim=-1))
    if attn.layer_idx in layers:
        for i in range(first, t):
            rels = []
            for h in range(heads):
                rels.append(
                    [
                        float(probs[h][i][tokens].sum()) / len(tokens) - bias[attn.layer_idx][h][j]
                        for j, tokens in enumerate(members)
                    ]
                )
            if heads_mode == "mean":
                rels = [[sum(col) / heads for col in zip(*rels, strict=True)]] * heads
            for h in range(heads):
                a = probs[h][i].clone()
                mass = [float(a[tokens].sum()) for tokens in members]
                alpha = torch.softmax(torch.tensor(rels[h], dtype=torch.float64) / temperature, 0)
                total = sum(mass)
                for j, tokens in enumerate(members):
                    a[tokens] = a[tokens] * (total * float(alpha[j]) / mass[j])
                probs[h][i] = a
    for h in range(heads):
        out[:, h] = probs[h] @ v[h // groups]
    return attn.o_proj(out.reshape(1, t, heads * d)), None


def _by_hand_logits(model, tokenizer, prompt, layers, temperature, extra=(), heads="each"):
    """Logits at every position of the prompt followed by ``extra`` tokens (readers)."""
    ids, members, first = _pieces(tokenizer, prompt)
    bias = _by_hand_bias(model, tokenizer, prompt, layers)
    state = (members, first, bias, set(layers), temperature, heads)

    def forward(attn, *args, **kwargs):
        return _by_hand_forward(attn, state, *args, **kwargs)

    with torch.no_grad(), patch_attention("by-hand", attention_modules(model), forward):
        return model(input_ids=torch.tensor([[*ids, *extra]]), use_cache=False).logits[0], first


@pytest.mark.parametrize(
    "arch, task, layers, heads",
    [
        ("llama", "qa", "upper", "each"),
        ("qwen2", "kv", "all", "each"),
        ("qwen3", "qa", "upper", "each"),
        ("llama", "kv", "upper", "mean"),
    ],
)
def test_calibrated_layers_equal_the_by_hand_computation(smol, arch, task, layers, heads):
    model = tiny_model(arch, seed=7, vocab_size=len(smol.tokenizer), num_hidden_layers=3)
    backend = CalibratedAttentionBackend(model, smol.tokenizer, layers=layers, heads=heads)
    calibrated = [1, 2] if layers == "upper" else [0, 1, 2]
    assert sorted(backend.layers) == calibrated
    if task == "kv":
        prompt = get_task("kv").prompt("k1", PAIRS)
    else:
        prompt = get_task("qa").prompt("Which river?", DOCS)
    layout = backend._layout(prompt)
    got, step = backend._forward([layout], keep=0)
    # three greedy steps over the run's cache: every generated token is a reader
    generated, stepped, tok = [], [], got[:, -1].argmax(-1)
    for _ in range(3):
        generated.append(tok.item())
        stepped.append(step(tok[:, None])[0, -1])
        tok = stepped[-1].argmax(-1)[None]
    want, first = _by_hand_logits(
        model, smol.tokenizer, prompt, calibrated, PAPER_TEMPERATURE, generated, heads
    )
    n = len(layout.ids)
    assert layout.ids == smol.encode(prompt) and layout.first == first
    torch.testing.assert_close(got[0], want[:n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.stack(stepped), want[n:], atol=1e-5, rtol=1e-4)
    # the calibration changes the readers' logits (the comparison is not vanilla against itself)
    vanilla = model(input_ids=torch.tensor([layout.ids])).logits[0]
    assert (got[0, first:] - vanilla[first:]).abs().max().item() > 1e-3


def test_other_rows_and_layers_stay_vanilla(smol):
    """Layers 0-1 of 4 (below L // 2) give vanilla's hidden states at every position; the
    calibrated layers give them before the first reader; the logits there are vanilla's."""
    model = tiny_model("llama", seed=8, vocab_size=len(smol.tokenizer), num_hidden_layers=4)
    backend = CalibratedAttentionBackend(model, smol.tokenizer)
    prompt = get_task("qa").prompt("Which river?", DOCS)
    layout = backend._layout(prompt)
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
        )
        for i, layer in enumerate(model.get_decoder().layers)
    ]
    try:
        got, _ = backend._forward([layout], keep=0)
        mine = dict(seen)
        vanilla = model(input_ids=torch.tensor([layout.ids]))
    finally:
        for h in hooks:
            h.remove()
    first = layout.first
    for i in (0, 1):
        torch.testing.assert_close(mine[i], seen[i], atol=1e-6, rtol=1e-5)
    for i in (2, 3):
        torch.testing.assert_close(mine[i][:, :first], seen[i][:, :first], atol=1e-6, rtol=1e-5)
        assert (mine[i][:, first:] - seen[i][:, first:]).abs().max().item() > 1e-4
    torch.testing.assert_close(got[0, :first], vanilla.logits[0, :first], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window, calibrated", [(64, False), (4096, True)])
def test_a_reader_whose_window_misses_a_passage_attends_as_the_model_does(smol, window, calibrated):
    """A Mistral whose every layer slides a window: with the passages (about 180 tokens) wider
    than the window, no reader sees them all and every logit is the plain model's; with a window
    that holds the prompt, the same prompt's readers are calibrated."""
    model = tiny_model(
        "mistral",
        seed=9,
        vocab_size=len(smol.tokenizer),
        sliding_window=window,
        num_hidden_layers=2,
    )
    backend = CalibratedAttentionBackend(model, smol.tokenizer, layers="all")
    layout = backend._layout(wide_passages_prompt())
    first_passage = next(t for t, b in enumerate(layout.blocks) if b >= 0)
    assert layout.first - first_passage > 64
    got, _ = backend._forward([layout], keep=0)
    vanilla = model(input_ids=torch.tensor([layout.ids])).logits[0]
    change = (got[0] - vanilla).abs().max().item()
    assert change > 1e-3 if calibrated else change < 1e-5
    assert backend.identity()["sliding_rule"] == CalibratedAttentionBackend.sliding_rule


def test_the_bias_is_measured_once_per_number_of_passages(smol, kv_samples):
    model = tiny_model("qwen2", seed=9, vocab_size=len(smol.tokenizer))
    backend = CalibratedAttentionBackend(model, smol.tokenizer)
    calls = []
    measure = backend._measure_bias
    backend._measure_bias = lambda free: calls.append(free) or measure(free)
    four = [task_prompt(s, s.passages_with_gold_at(p)) for s in kv_samples for p in (0, 3)]
    backend.next_token_logprobs(four, batch_size=2)
    backend.generate(four[:1], max_new_tokens=2)
    assert len(calls) == 1 and calls[0] == four[0].no_content
    three = [task_prompt(s, s.passages_with_gold_at(1)[:3]) for s in kv_samples]
    backend.next_token_logprobs(three)
    assert len(calls) == 2 and len(calls[1].passages) == 3
    bias = backend.positional_bias(four[1])
    assert len(calls) == 2 and sorted(bias) == [1] and bias[1].shape == (4, 4)
    assert bool((bias[1] > 0).all()) and bool((bias[1] < 1).all())


def test_a_batch_gives_each_prompt_its_own_answer(smol, kv_samples):
    model = tiny_model("qwen3", seed=10, vocab_size=len(smol.tokenizer))
    backend = CalibratedAttentionBackend(model, smol.tokenizer)
    s = kv_samples[0]
    prompts = [
        task_prompt(s, s.passages_with_gold_at(2)),
        get_task("qa").prompt("Which river?", DOCS),  # shorter, other number of passages
    ]
    both = backend.next_token_logprobs(prompts, batch_size=2)
    alone = torch.cat([backend.next_token_logprobs([p]) for p in prompts])
    torch.testing.assert_close(both, alone, atol=1e-5, rtol=1e-4)
    gens = backend.generate(prompts, batch_size=2, max_new_tokens=3)
    assert [g.token_ids for g in gens] == [
        backend.generate([p], max_new_tokens=3)[0].token_ids for p in prompts
    ]


def test_real_smollm2_on_real_kv_data(smol, kv_samples):
    """The real SmolLM2 answers real KV prompts through the calibrated attention: text comes
    back, read from exactly vanilla's tokens, and the model is left unpatched."""
    backend = CalibratedAttentionBackend(smol.model, smol.tokenizer)
    sample = kv_samples[0]
    prompts = [task_prompt(sample, sample.passages_with_gold_at(p)) for p in (0, 3)]
    gens = backend.generate(prompts, batch_size=2, max_new_tokens=12)
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.text.strip() and gen.new_tokens > 0
        assert gen.prompt_tokens == len(smol.encode(prompt)) == len(backend.encode(prompt))
    assert "".join(backend.stream(prompts[1], max_new_tokens=12)).strip() == gens[1].text
    (ll,) = backend.loglikelihood([(prompts[1], sample.answers[0])])
    assert ll < 0
    assert all("forward" not in m.__dict__ for m in backend.attentions)
    assert smol.model.config._attn_implementation == "sdpa"


def test_refusals(smol):
    model = tiny_model("llama", seed=11, vocab_size=len(smol.tokenizer))
    backend = CalibratedAttentionBackend(model, smol.tokenizer)
    for prompt in ("Where is Paris?", TaskPrompt(user="no passages")):
        with pytest.raises(RagfixError, match="does not say where they are") as err:
            backend.generate([prompt])
        assert "\n" not in str(err.value)
    bare = get_task("qa")._prompt("Which river?", DOCS)  # spans, no content-free forms
    with pytest.raises(RagfixError, match="content-free form"):
        backend.next_token_logprobs([bare])
    for t in (0, -1e-3):
        with pytest.raises(ValueError, match="temperature"):
            CalibratedAttentionBackend(model, smol.tokenizer, temperature=t)
        with pytest.raises(ValueError, match="temperature"):
            CalibratedAttentionOptions(temperature=t)
    prompt = get_task("qa").prompt("Which river?", DOCS)
    other = patch_attention("channel-scaled", backend.attentions, lambda attn, *a, **k: None)
    with other, pytest.raises(IncompatibleMethodsError) as err:
        backend.next_token_logprobs([prompt])
    assert "calibrated-attention cannot be combined with channel-scaled" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(Exception, match="temperature"):
        load_backend("calibrated-attention", temperature=0)
