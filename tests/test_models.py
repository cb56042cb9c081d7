import pytest
import torch
from conftest import tiny_model

from ragfix.backends.hf import HFBackend
from ragfix.errors import ModelLoadError, ModelNotFoundError
from ragfix.models.gguf import check_gguf, converted_dir
from ragfix.models.load import load_model, model_identity
from ragfix.models.resolve import resolve_model
from ragfix.prompts import NO_CHAT_TEMPLATE, TaskPrompt
from ragfix.tasks import get_task, task_prompt
from ragfix.types import Passage


def test_resolve_errors_are_clear(tmp_path):
    with pytest.raises(ModelNotFoundError, match="path not found"):
        resolve_model("./no/such/model")
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "x.gguf"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").source == "hub"
    assert resolve_model("smollm2").source == "gguf"


def test_mistyped_model_name_fails_at_once_with_a_suggestion():
    # issue 14: no minute of hub retries; the name is said to be read as a hub id
    import time

    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="read as a Hugging Face hub id.*'smollm2'"):
        load_model("smollm", device="cpu")
    assert time.perf_counter() - start < 15


def test_smollm2_is_the_documented_model(smol):
    cfg = smol.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, smol.context_window) == (30, 576, 8192)
    ident = model_identity(smol.model)
    assert ident["architecture"] == "LlamaForCausalLM" and ident["name"] == "smollm2"


def test_smollm2_answers_a_one_document_question(smol):
    doc = Passage(title="France", text="Paris is the capital and largest city of France.")
    [gen] = smol.generate(
        [TaskPrompt(user=get_task("qa").user_turn("What is the capital of France?", [doc]))]
    )
    assert "paris" in gen.text.lower()
    assert "\n" not in gen.text and 0 < gen.new_tokens <= 32
    assert gen.prompt_tokens == gen.prefill_tokens > 50


def test_batched_left_padding_matches_single(smol):
    docs = [Passage(title="Moon", text="The Moon orbits the Earth every 27 days.")]
    prompts = [
        TaskPrompt(user=get_task("qa").user_turn("What does the Moon orbit?", docs)),
        TaskPrompt(user="Answer in one word: what colour is the sky on a clear day?"),
    ]
    batched = smol.generate(prompts, batch_size=2)
    single = [smol.generate([p])[0] for p in prompts]
    assert [g.text for g in batched] == [g.text for g in single]


def test_kv_prompt_is_prefilled_with_the_answer_opening(smol):
    from ragfix.types import QASample

    s = QASample(
        id="x",
        task="kv",
        question="k1",
        answers=["v1"],
        gold=Passage(title="k1", text="v1", is_gold=True),
        distractors=[Passage(title="k0", text="v0")],
    )
    tp = task_prompt(s, s.passages_with_gold_at(1))
    text = smol.format_prompt(tp)
    assert text.endswith('<|im_start|>assistant\nThe value of key "k1" is "')
    assert '{"k0": "v0",\n "k1": "v1"}' in tp.user


def test_fingerprint_tells_weights_apart_and_ignores_dtype():
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    fa = model_identity(a)["fingerprint"]
    assert fa != model_identity(b)["fingerprint"]
    assert fa == model_identity(tiny_model(seed=1).to(torch.bfloat16))["fingerprint"]
    assert fa != model_identity(tiny_model("qwen2", seed=1))["fingerprint"]


# ---------------------------------------------------------------- model files (cases 16, 17, 22)
def _write_gguf(path, arch: str) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch=arch)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def test_gguf_cache_is_keyed_by_content_not_name_and_size(tmp_path, monkeypatch):
    # case 22: same file name, same size, different bytes -> different converted checkpoints
    monkeypatch.setenv("RAGFIX_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert a.stat().st_size == b.stat().st_size
    assert converted_dir(a) != converted_dir(b)
    before = converted_dir(a)
    a.write_bytes(b"GGUF" + bytes(99) + b"\x02")  # changed in place, same size
    assert converted_dir(a) != before


def test_bad_gguf_files_fail_in_one_line_naming_the_file(tmp_path):
    # case 17
    _write_gguf(tmp_path / "unsupported_arch.gguf", "notarealarch")
    with pytest.raises(ModelLoadError, match=r'unsupported_arch.gguf: GGUF architecture "notarea'):
        check_gguf(tmp_path / "unsupported_arch.gguf")
    with pytest.raises(ModelLoadError, match=r"supported: .*llama"):
        check_gguf(tmp_path / "unsupported_arch.gguf")
    full = (tmp_path / "unsupported_arch.gguf").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(full[:16])
    with pytest.raises(ModelLoadError, match="truncated.gguf: not a complete GGUF file"):
        check_gguf(tmp_path / "truncated.gguf")
    (tmp_path / "not_gguf.gguf").write_text("hello, I am text\n")
    with pytest.raises(ModelLoadError, match="not_gguf.gguf: not a GGUF file .bad magic"):
        load_model(str(tmp_path / "not_gguf.gguf"), device="cpu")


def test_chat_template_ids_and_missing_template(smol, tmp_path):
    # case 16: the ids sent are the template's own ids (no second BOS), and a tokenizer without a
    # template is warned about and recorded in the identity
    msgs = [{"role": "user", "content": "test"}]
    want = smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert smol.encode(TaskPrompt(user="test")) == list(want)
    assert smol.identity()["chat_template"] != NO_CHAT_TEMPLATE
    import copy

    tok = copy.deepcopy(smol.tokenizer)
    tok.chat_template = None
    with pytest.warns(UserWarning, match="no chat template"):
        b = HFBackend(tiny_model(vocab_size=len(tok)), tok)
    assert b.identity()["chat_template"] == NO_CHAT_TEMPLATE
    assert b.format_prompt(TaskPrompt(user="q", assistant_prefix="A:")) == "q\nA:"
    # a task's prompt reads in its completion form: the template ends where the answer starts
    kv = get_task("kv").prompt("k1", [Passage(title="k1", text="v1")])
    assert b.format_prompt(kv).endswith('"k1": "v1"}\n\nKey: "k1"\nCorresponding value: "')
    qa = get_task("qa").prompt("Which river?", [Passage(title="T", text="The Seine.")])
    assert b.format_prompt(qa).endswith("Question: Which river?\nAnswer:")


# ---------------------------------------------------------------- batch mates, streams (24, 29)
def test_dynamic_ntk_answers_do_not_depend_on_batch_mates(smol):
    # case 24: dynamic NTK picks its RoPE base from the batch's longest row, so it never batches
    from ragfix.backends.rope_scaled import RopeScaledBackend

    short = TaskPrompt(user="Write one sentence about the sea.", max_new_tokens=6)
    long_text = "The old harbour wall was repaired every spring by the fishermen. " * 12
    long = TaskPrompt(user=long_text + "How often was the wall repaired?", max_new_tokens=6)
    vanilla = smol.next_token_logprobs([short])[0]
    saved = smol.model.get_decoder().rotary_emb
    try:
        b = RopeScaledBackend(smol.model, smol.tokenizer, rope_type="dynamic", train_window=64)
        assert not b.supports_batching and not b.supports_prefix_reuse
        together = [g.text for g in b.generate([short, long], batch_size=8)]
        alone = [b.generate([p])[0].text for p in (short, long)]
        assert together == alone
        # within the window dynamic NTK is plain RoPE, also after a long prompt went through
        assert (b.next_token_logprobs([short])[0] - vanilla).abs().max() < 1e-4
    finally:
        smol.model.get_decoder().rotary_emb = saved


def test_closing_a_stream_stops_generation(smol):
    # case 29: an abandoned stream must not keep the generation thread running
    import threading
    import time

    before = threading.active_count()
    stream = smol.stream(TaskPrompt(user="Write a long story about a lighthouse keeper."), 200)
    first = next(stream)
    start = time.perf_counter()
    stream.close()
    assert first and time.perf_counter() - start < 5
    assert threading.active_count() == before


def test_shared_prefix_batch_equals_naive_answers(smol):
    # issue 17: the cells of one sample prefilled along their token trie (each cell after the
    # prefix it shares with the one before) and decoded in one batch give the naive path's
    # answers and first-step log-probs
    from ragfix.bundled import bundled_path
    from ragfix.connectors.litm import load_samples

    s = load_samples(bundled_path("kv-sample"), num_docs=6, limit=1)[0]
    prompts = [task_prompt(s, s.passages_with_gold_at(p)) for p in (5, 3, 0)]
    naive = smol.generate(prompts, batch_size=1, first_logprobs=True)
    fresh = HFBackend(smol.model, smol.tokenizer)  # no prefix cached by an earlier test
    shared = fresh.generate(prompts, batch_size=3, prefix_reuse=True, first_logprobs=True)
    assert [g.text for g in shared] == [g.text for g in naive]
    assert len({g.new_tokens for g in naive}) > 1  # the rows stop at their own newline
    assert [g.new_tokens for g in shared] == [g.new_tokens for g in naive]
    for a, b in zip(naive, shared, strict=True):
        torch.testing.assert_close(a.first_logprobs, b.first_logprobs, rtol=1e-4, atol=1e-4)
    encoded = [smol.encode(p) for p in prompts]
    assert sum(g.prefill_tokens for g in shared) == _trie_nodes(encoded) + len(prompts)
    assert sum(g.prefill_tokens for g in naive) - sum(g.prefill_tokens for g in shared) > 100


# ---------------------------------------------------------------- trie prefill, batched decode
class _IdTokenizer:
    """A tokenizer whose text is the token ids written out (``"5 17 9"``), so a test builds its
    prompts token by token; EOS and padding ids are settable."""

    chat_template = "ids"

    def __init__(self, eos: int = 2, pad: int = 0):
        self.eos_token_id, self.pad_token_id = eos, pad

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [int(x) for x in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def _trie_nodes(prompts: list[list[int]]) -> int:
    """Nodes of the token trie of the prompts minus their last token: each distinct non-empty
    prefix once (the fewest tokens any prefill that shares computed prefixes can run)."""
    return len({tuple(p[:k]) for p in prompts for k in range(1, len(p))})


def _trie_prompts() -> list[list[int]]:
    """Six prompts in depth-first trie order: 124 tokens, two of its prefixes (25 and 16
    tokens), an 18-token branch off their shared 6-token head, a 3-token and a 1-token prompt."""
    g = torch.Generator().manual_seed(1)
    head, x1, x2, y, z, w = (
        torch.randint(3, 250, (n,), generator=g).tolist() for n in (6, 10, 7, 9, 5, 99)
    )
    return [head + x1 + y + w, head + x1 + y, head + x1, head + x2 + z, head[:3], head[:1]]


@pytest.mark.parametrize("arch, attn", [("llama", "eager"), ("qwen2", "eager"), ("llama", "sdpa")])
def test_trie_prefill_and_batched_decode_give_the_naive_tokens(arch, attn):
    # issue 17: prompts prefilled along their token trie over one cache (cropped and extended),
    # each row's cache stacked left padded into one batch and decoded together: the greedy
    # tokens, stop steps and first-step log-probs of each prompt run alone from scratch, and the
    # trie's token count prefilled, also when the group spans several calls. The weights are
    # drawn wide (initializer_range 0.1) so that one position off changes the tokens.
    model = tiny_model(arch, seed=0, attn=attn, initializer_range=0.1)
    tok = _IdTokenizer()
    prompts = _trie_prompts()
    text = [" ".join(map(str, p)) for p in prompts]
    kw = {"max_new_tokens": 12, "stop_at_newline": False}
    first = HFBackend(model, tok).generate(text, batch_size=1, **kw)
    # EOS: a token that a row first produces at its fourth step or later, so rows stop apart
    eos = next(
        int(t)
        for g in first
        for k, t in enumerate(g.text.split())
        if k >= 3 and t not in g.text.split()[:k]
    )
    tok.eos_token_id = eos
    naive = HFBackend(model, tok).generate(text, batch_size=1, first_logprobs=True, **kw)
    assert [g.prefill_tokens for g in naive] == [len(p) for p in prompts]
    assert len({g.new_tokens for g in naive}) > 1  # the rows stop at different steps
    assert all(len(g.token_ids) == g.new_tokens for g in naive)
    assert all(g.token_ids[-1] == eos for g in naive if g.new_tokens < kw["max_new_tokens"])
    for size in (6, 4, 2):
        backend = HFBackend(model, tok)
        gens = backend.generate(text, batch_size=size, prefix_reuse=True, first_logprobs=True, **kw)
        assert [g.token_ids for g in gens] == [g.token_ids for g in naive], size
        assert [g.text for g in gens] == [g.text for g in naive], size
        assert [g.new_tokens for g in gens] == [g.new_tokens for g in naive], size
        assert [g.prompt_tokens for g in gens] == [len(p) for p in prompts]
        for a, b in zip(naive, gens, strict=True):
            torch.testing.assert_close(a.first_logprobs, b.first_logprobs, rtol=0, atol=1e-4)
        assert sum(g.prefill_tokens for g in gens) == _trie_nodes(prompts) + len(prompts), size
    # a later call's first row continues from the prefix the cache holds (the last row's)
    backend.generate(text[2:3], batch_size=2, prefix_reuse=True, **kw)
    [again] = backend.generate(text[:1], batch_size=2, prefix_reuse=True, **kw)
    assert again.text == naive[0].text
    assert again.prefill_tokens == len(prompts[0]) - len(prompts[2]) + 1


@pytest.mark.parametrize("size", [1, 2])
def test_an_interrupted_forward_leaves_the_prefix_cache_usable(size):
    # the kept cache is cropped and extended before a forward that fails: what it is said to
    # hold must still be what it holds, or the next prompt reuses keys of other tokens
    model = tiny_model("llama", seed=0, initializer_range=0.1)
    tok = _IdTokenizer()
    text = [" ".join(map(str, p)) for p in _trie_prompts()]
    kw = {"max_new_tokens": 6, "stop_at_newline": False, "prefix_reuse": True}
    backend = HFBackend(model, tok)
    backend.generate(text[1:2], batch_size=size, **kw)  # the cache holds head + x1 + y

    def fail(*args):
        raise RuntimeError("interrupted")

    hook = model.get_decoder().norm.register_forward_hook(fail)  # after every layer's update
    with pytest.raises(RuntimeError, match="interrupted"):
        backend.generate(text[3:4], batch_size=size, **kw)  # cropped to head, + x2 + z
    hook.remove()
    [again] = backend.generate(text[2:3], batch_size=size, **kw)  # head + x1
    [naive] = HFBackend(model, tok).generate(text[2:3], max_new_tokens=6, stop_at_newline=False)
    assert again.token_ids == naive.token_ids
