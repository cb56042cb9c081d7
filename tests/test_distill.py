"""Pos2Distill (arXiv 2508.15709): weights, KL, data construction, training, adapters, backend."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
from conftest import shared_file, tiny_model
from typer.testing import CliRunner

from ragfix.connectors.litm import load_samples
from ragfix.distill import (
    METADATA_FILE,
    DistillSettings,
    Example,
    answer_logits,
    apply_adapter,
    arrange,
    collate,
    compose_two_passage,
    exclude_questions,
    extract_final_answer,
    per_sample_kl,
    position_weights,
    r1_rows,
    r2_rows,
    save_adapter,
    shorten_sample,
    stack_teacher,
    teacher_logprobs,
    train_loop,
)
from ragfix.models import model_identity

EVAL_FILE = "derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz"
ORACLE_FILE = "litm_nq_open_oracle.jsonl.gz"


# ------------------------------------------------------------------ weights and KL
def test_position_weights_hand_computed():
    kl = torch.tensor([0.2, 0.4, 0.1, 0.3, 0.5, 0.7])
    pos = torch.tensor([1, 1, 3, 3, 0, 0])
    anchor = torch.tensor([False, False, False, False, True, True])
    w = position_weights(kl, pos, anchor, anchor_weight=1.0)
    # means: position 1 -> 0.3, position 3 -> 0.2; softmax([0.3, 0.2]) * 2 positions
    c1 = 2 * math.exp(0.3) / (math.exp(0.3) + math.exp(0.2))  # 1.049958
    c3 = 2 - c1  # 0.950042
    expected = [c1 / 2 * 0.2 / 0.4, c1 / 2 * 1.0, c3 / 2 * 0.1 / 0.3, c3 / 2 * 1.0, 1.0, 1.0]
    assert w.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[:4] == pytest.approx([0.262490, 0.524979, 0.158340, 0.475021], abs=1e-6)
    # lambda scales only the anchoring rows
    w2 = position_weights(kl, pos, anchor, anchor_weight=0.5)
    assert w2[4:].tolist() == [0.5, 0.5] and torch.equal(w2[:4], w[:4])


def _examples(vocab: int, seed: int, n: int, prompt_len=(6, 14), answer_len=(2, 5)):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
        answer = [rng.randrange(3, vocab) for _ in range(rng.randint(*answer_len))] + [2]
        out.append(Example(prompt, answer, position=1 + i % 3, anchor=i % 4 == 3, key=f"q{i}"))
    return out


def test_kl_zero_on_the_teacher_prompt_and_padding_invariant():
    model = tiny_model(seed=1)
    ex = _examples(256, 0, 3)
    cache = {e.key: teacher_logprobs(model, e) for e in ex}
    assert cache["q0"].shape == (len(ex[0].answer_ids), 256)
    batch = collate(ex, pad_id=0, device="cpu")
    with torch.no_grad():
        logits = answer_logits(model, batch)
        teacher = stack_teacher(ex, cache, batch["mask"].shape[1], "cpu")
        kl = per_sample_kl(teacher, logits, batch["mask"])
    # same prompt for teacher and student (left padding and position ids do not change it)
    assert kl.abs().max().item() < 1e-5
    # another prompt for the student, same answer: KL > 0
    moved = [Example(e.prompt_ids[::-1], e.answer_ids, 1, False, e.key) for e in ex]
    b2 = collate(moved, pad_id=0, device="cpu")
    with torch.no_grad():
        kl2 = per_sample_kl(teacher, answer_logits(model, b2), b2["mask"])
    assert (kl2 > 1e-4).all()


# ------------------------------------------------------------------ data construction
def test_r1_rows_keep_the_distractors_and_put_the_gold_where_asked():
    samples = load_samples(shared_file(EVAL_FILE), 10, limit=3)
    rng = random.Random(0)
    for s in samples:
        rows = r1_rows(s, "x", positions_per_question=4, anchor=0, anchor_copies=1, rng=rng)
        assert len(rows) == 5 and [r.anchor for r in rows] == [False] * 4 + [True]
        trivial = [r.positions[0] for r in rows[:4]]
        assert len(set(trivial)) == 4 and 0 not in trivial and rows[4].positions == [0]
        for r in rows:
            ctx = arrange(s, r.positions, r.order)
            assert ctx[r.positions[0]] == s.gold and sum(p.is_gold for p in ctx) == 1
            others = [p for p in ctx if not p.is_gold]
            assert sorted(others, key=lambda p: p.text) == sorted(
                s.distractors, key=lambda p: p.text
            )
        assert len({tuple(r.order) for r in rows}) == 5  # a fresh shuffle per copy
    # the teacher's context is the file order with the gold at the anchor
    assert arrange(samples[0], [0]) == samples[0].passages_with_gold_at(0)


def test_truncation_keeps_the_answer_in_the_gold_passage():
    (s,) = load_samples(shared_file(EVAL_FILE), 4, limit=1)
    short = shorten_sample(s, 12)
    assert all(len(p.text.split()) <= 12 for p in [short.gold, *short.distractors])
    assert any(a.lower() in short.gold.text.lower() for a in s.answers)


def test_r2_rows_and_two_passage_questions():
    singles = load_samples(shared_file(EVAL_FILE), 6, limit=4)
    multi = compose_two_passage(singles, 6)
    assert len(multi) == 2 and multi[0].answers == [singles[0].answers, singles[1].answers]
    m = multi[0]
    rows = r2_rows(m, "cot", positions_per_question=4, rng=random.Random(1))
    pairs = [tuple(r.positions) for r in rows]
    assert len(set(pairs)) == 4 and (4, 5) not in pairs and all(a != b for a, b in pairs)
    for r in rows:
        ctx = arrange(m, r.positions, r.order)
        assert [ctx[p] for p in r.positions] == m.golds and len(ctx) == 6
    assert extract_final_answer("so... The answer is: Paris and 1990") == "Paris and 1990"


def test_training_questions_are_disjoint_from_evaluation_questions():
    eval_samples = load_samples(shared_file(EVAL_FILE), 1, limit=40)
    oracle = load_samples(shared_file(ORACLE_FILE), 1, limit=260)
    kept = exclude_questions(oracle, eval_samples)
    # the derived evaluation file is built from the first oracle questions
    assert len(kept) == 260 - 40
    assert not {s.id for s in kept} & {s.id for s in eval_samples}
    assert {s.question for s in kept}.isdisjoint({s.question for s in eval_samples})


# ------------------------------------------------------------------ training
def _tiny_run(tmp_path, name, settings, stop_after=None, seed=1):
    model = tiny_model(seed=seed)
    ex = _examples(256, 0, 8)
    teacher_ex = _examples(256, 99, 8)  # the teacher sees other prompts, same answers
    cache = {
        t.key: teacher_logprobs(model, Example(t.prompt_ids, e.answer_ids, 0, False, e.key))
        for t, e in zip(teacher_ex, ex, strict=True)
    }
    out = tmp_path / name
    trained, res = train_loop(
        model, ex, settings, out, teacher_cache=cache, stop_after=stop_after, show_progress=False
    )
    return trained, res, ex, cache, out


def _mean_kl(model, ex, cache):
    batch = collate(ex, 0, "cpu")
    with torch.no_grad():
        t = stack_teacher(ex, cache, batch["mask"].shape[1], "cpu")
        return per_sample_kl(t, answer_logits(model, batch), batch["mask"]).mean().item()


SETTINGS = DistillSettings(effective_batch=4, micro_batch=2, lr=5e-3, epochs=3, save_every=2)


def test_a_few_steps_reduce_the_kl(tmp_path):
    trained, res, ex, cache, out = _tiny_run(tmp_path, "a", SETTINGS)
    before = _mean_kl(tiny_model(seed=1), ex, cache)
    after = _mean_kl(trained, ex, cache)
    assert res.steps == res.total_steps == 6 and res.finished
    assert after < 0.8 * before, (before, after)
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 6 and "anchor" in log[0]["kl_by_position"]


def test_resume_gives_the_same_weights_and_adapters_round_trip(tmp_path):
    full, _, ex, cache, _ = _tiny_run(tmp_path, "full", SETTINGS)
    _, part, *_ = _tiny_run(tmp_path, "resumed", SETTINGS, stop_after=3)
    assert part.steps == 3 and not part.finished
    resumed, res, *_ = _tiny_run(tmp_path, "resumed", SETTINGS)
    assert res.steps == 6 and res.finished
    for (n, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n
    # save, then load onto a fresh copy of the same base model: same logits as the trained model
    meta = {"format": "ragfix-pos2distill", "kind": "lora", "variant": "r1"}
    meta["base_model"] = model_identity(tiny_model(seed=1))
    save_adapter(full, tmp_path / "adapter", meta)
    loaded, got = apply_adapter(tiny_model(seed=1), tmp_path / "adapter", merge=True)
    assert got["variant"] == "r1"
    assert _mean_kl(loaded, ex, cache) == pytest.approx(_mean_kl(full, ex, cache), abs=1e-5)
    with pytest.raises(ValueError, match="adapter was trained on base model"):
        apply_adapter(tiny_model("qwen2", seed=1), tmp_path / "adapter")


def test_r2_cross_entropy_training_reduces_the_loss(tmp_path):
    from ragfix.distill import per_sample_ce

    settings = SETTINGS.model_copy(update={"variant": "r2"})
    ex = _examples(256, 5, 8)
    trained, res = train_loop(tiny_model(seed=1), ex, settings, tmp_path, show_progress=False)

    def ce(model):
        batch = collate(ex, 0, "cpu")
        with torch.no_grad():
            return per_sample_ce(answer_logits(model, batch), batch["targets"], batch["mask"])

    before, after = ce(tiny_model(seed=1)), ce(trained)
    assert before.mean() == pytest.approx(math.log(256), rel=0.05)  # random init: uniform-ish
    assert res.finished and after.mean() < 0.95 * before.mean()  # measured: 5.56 -> 5.01


def test_full_finetune_option_trains_every_weight(tmp_path):
    settings = SETTINGS.model_copy(update={"full_finetune": True, "lr": 1e-3, "epochs": 1})
    trained, res, ex, cache, _ = _tiny_run(tmp_path, "ft", settings)
    base = tiny_model(seed=1)
    assert res.steps == 2
    changed = [
        n
        for (n, a), (_, b) in zip(trained.named_parameters(), base.named_parameters(), strict=True)
        if not torch.equal(a, b)
    ]
    assert len(changed) == len(list(base.parameters()))


# ------------------------------------------------------------------ real model: CLI and backend
@pytest.fixture(scope="module")
def smol_adapter(smol, tmp_path_factory):
    """A random (seeded, non-zero) LoRA adapter on the real SmolLM2, saved as `ragfix distill`
    saves one: exercises loading, merging and composition without a training run."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(smol.model), cfg)
    out = tmp_path_factory.mktemp("p2d") / "smol-random"
    meta = {"format": "ragfix-pos2distill", "kind": "lora", "variant": "r1"}
    save_adapter(peft_model, out, {**meta, "base_model": model_identity(smol.model)})
    return out


@pytest.mark.slow
def test_cli_trains_a_real_adapter(tmp_path, smol):
    """`ragfix distill r1` end to end on SmolLM2: 2 questions, 3 documents, 2 steps."""
    from ragfix.cli.app import app

    out = tmp_path / "smol-r1"
    args = ["distill", "r1", "--train", str(shared_file(ORACLE_FILE)), "--out", str(out)]
    args += ["--exclude", str(shared_file(EVAL_FILE)), "--offset", "200", "--candidates", "16"]
    args += ["--questions", "2", "--num-docs", "3", "--max-passage-words", "24"]
    args += ["--positions-per-question", "2", "--effective-batch", "3", "--lr", "5e-3"]
    args += ["--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "adapter written" in res.output
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["base_model"]["fingerprint"] == model_identity(smol.model)["fingerprint"]
    assert len(meta["train_question_ids"]) == 2 and meta["rows"] == 6 and meta["steps"] == 2
    assert len(meta["excluded_question_ids"]) == 200
    assert not set(meta["train_question_ids"]) & set(meta["excluded_question_ids"])
    assert meta["settings"]["num_docs"] == 3 and meta["kind"] == "lora"
    assert (out / "adapter_model.safetensors").exists() and not (out / "checkpoint.pt").exists()


def test_backend_merged_unmerged_and_under_gali(smol_adapter, smol):
    from ragfix.backends.pos2distill import Pos2DistillBackend
    from ragfix.prompts import TaskPrompt

    prompt = TaskPrompt(user="Question: who wrote hamlet?\nAnswer:")
    merged = Pos2DistillBackend(
        copy.deepcopy(smol.model), smol.tokenizer, adapter=str(smol_adapter)
    )
    unmerged = Pos2DistillBackend(
        copy.deepcopy(smol.model), smol.tokenizer, adapter=str(smol_adapter), merge=False
    )
    lp_m, lp_u = merged.next_token_logprobs(prompt), unmerged.next_token_logprobs(prompt)
    lp_v = smol.next_token_logprobs(prompt)
    assert torch.allclose(lp_m, lp_u, atol=1e-4)
    assert (lp_m - lp_v).abs().max().item() > 1e-3  # the adapter changes the model
    gali = Pos2DistillBackend(
        copy.deepcopy(smol.model),
        smol.tokenizer,
        adapter=str(smol_adapter),
        base="gali",
        base_options={"noise": False},
    )
    assert gali.inner.name == "gali" and gali.identity()["inner"]["backend"] == "gali"
    # a prompt inside the trained window runs unmodified under GALI: same as the merged adapter
    assert torch.allclose(gali.next_token_logprobs(prompt), lp_m, atol=1e-4)
    (g,) = merged.generate([prompt], max_new_tokens=8)
    assert g.new_tokens >= 1
    with pytest.raises(ValueError, match="unmerged adapter runs only under the vanilla"):
        Pos2DistillBackend(smol.model, smol.tokenizer, adapter=str(smol_adapter), merge=False,
                           base="gali")  # fmt: skip


def test_backend_refuses_an_adapter_of_another_base_model(tmp_path, smol):
    tiny = tiny_model(seed=3)
    meta = {"format": "ragfix-pos2distill", "kind": "lora", "variant": "r1"}
    meta["base_model"] = model_identity(tiny)
    from peft import LoraConfig, get_peft_model

    save_adapter(get_peft_model(tiny, LoraConfig(r=2, target_modules="all-linear")), tmp_path, meta)
    from ragfix.backends.pos2distill import Pos2DistillBackend

    with pytest.raises(ValueError, match="adapter was trained on base model"):
        Pos2DistillBackend(smol.model, smol.tokenizer, adapter=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=METADATA_FILE):
        Pos2DistillBackend(smol.model, smol.tokenizer, adapter=str(tmp_path / "nope"))
