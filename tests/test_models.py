import pytest
import torch
from conftest import tiny_model

from ragfix.models import ModelNotFoundError, model_identity, resolve_model
from ragfix.prompts import TaskPrompt, qa_prompt, task_prompt
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


def test_smollm2_is_the_documented_model(smol):
    cfg = smol.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, smol.context_window) == (30, 576, 8192)
    ident = model_identity(smol.model)
    assert ident["architecture"] == "LlamaForCausalLM" and ident["name"] == "smollm2"


def test_smollm2_answers_a_one_document_question(smol):
    doc = Passage(title="France", text="Paris is the capital and largest city of France.")
    [gen] = smol.generate([TaskPrompt(user=qa_prompt("What is the capital of France?", [doc]))])
    assert "paris" in gen.text.lower()
    assert "\n" not in gen.text and 0 < gen.new_tokens <= 32
    assert gen.prompt_tokens == gen.prefill_tokens > 50


def test_batched_left_padding_matches_single(smol):
    docs = [Passage(title="Moon", text="The Moon orbits the Earth every 27 days.")]
    prompts = [
        TaskPrompt(user=qa_prompt("What does the Moon orbit?", docs)),
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
