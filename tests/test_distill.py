"""Pos2Distill (arXiv 2508.15709): weights, KL, data construction, training, checkpoints, the
whole `distill()` run, adapters as a load option of the backends."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
from conftest import data_file, tiny_model
from typer.testing import CliRunner

from ragfix.connectors.litm import load_samples
from ragfix.distill import (
    CHECKPOINT_DIR,
    DistillSettings,
    Example,
    TeacherReport,
    answer_logits,
    answer_problem,
    arrange,
    build_rows,
    collate,
    compose_two_passage,
    distill,
    exclude_questions,
    extract_final_answer,
    per_sample_kl,
    position_weights,
    r1_rows,
    r2_rows,
    resolve_anchor,
    save_adapter,
    shorten_sample,
    stack_teacher,
    teacher_logprobs,
    teacher_prompt,
    train_loop,
)
from ragfix.errors import AdapterError, ConfigError, DataError
from ragfix.lora import METADATA_FILE, load_adapter
from ragfix.models.load import load_model, model_identity
from ragfix.types import Passage, QASample

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
    samples = load_samples(data_file(EVAL_FILE), 10, limit=3)
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


class _ScriptedTeacher:
    """Answers the teacher prompts with the given texts, in order (the filter's mechanism)."""

    def __init__(self, texts):
        self.texts = iter(texts)

    def generate(self, prompts, **kw):
        from ragfix.types import Generation

        return [
            Generation(
                text=next(self.texts), prompt_tokens=1, new_tokens=1, prefill_tokens=1, seconds=0
            )
            for _ in prompts
        ]


def test_teacher_answers_that_quote_passages_or_run_long_are_dropped_and_counted():
    # issue 15: an NQ teacher answer that quotes a passage label passes best_subspan_em (the
    # gold string is inside the quotation) but teaches the student to recite the context
    samples = load_samples(data_file(EVAL_FILE), 10, limit=5)
    gold = [s.answers[0] for s in samples]
    settings = DistillSettings(questions=5, max_answer_words=6)
    texts = [
        gold[0],  # kept
        f"Document [3](Title: {samples[1].gold.title}) {gold[1]}",  # quotes a passage label
        f"The answer to this question, as the passages say, is {gold[2]}",  # 10+ words
        "I do not know",  # wrong
        f"{gold[4]}\nDocument [1](Title: x)",  # kept: the metric reads the first line
    ]
    kept, rows, report = build_rows(_ScriptedTeacher(texts), samples, settings)
    assert [s.id for s in kept] == [samples[0].id, samples[4].id]
    assert report == TeacherReport(tried=5, kept=2, wrong=1, quotes_passage=1, too_long=1)
    assert len(rows) == 2 * (settings.positions_per_question + settings.anchor_copies)
    assert answer_problem(samples[0], "Document [2] says so", settings) == "quotes_passage"
    assert answer_problem(samples[0], "", settings) == "empty"
    # KV values are not QA answers: no word limit
    kv = load_samples(data_file("litm_kv_retrieval_75_keys.jsonl.gz"), 8, limit=1)[0]
    assert answer_problem(kv, "a b c d e f g h", settings) is None


def test_r2_final_answers_that_quote_a_passage_are_dropped_and_counted():
    # the one answer SmolLM2 got "right" on two-passage questions put a whole quoted passage
    # after "The answer is:"; both gold strings were in it, so it passed the R2 check
    singles = load_samples(data_file(EVAL_FILE), 6, limit=6)
    multi = compose_two_passage(singles, 6)
    settings = DistillSettings(variant="r2", questions=3, max_answer_words=4)
    (a1, b1), (a2, b2), (a3, b3) = ([h[0] for h in m.answers] for m in multi)
    listed = f"Document [1](Title: {multi[0].golds[0].title}) says {a1}."
    texts = [
        f"{listed}\nThe answer is: {a1} and {b1}",  # kept: the chain may list the passages
        f"The answer is: Document [2](Title: {multi[1].golds[1].title}) {a2} ... {b2}",
        f"The answer is: {a3}, as the passage says, and {b3}, as the other one says",
    ]
    kept, rows, report = build_rows(_ScriptedTeacher(texts), multi, settings)
    assert [m.id for m in kept] == [multi[0].id]
    assert report == TeacherReport(tried=3, kept=1, quotes_passage=1, too_long=1)
    # the word limit is per hop: two short answers pass a limit of four words
    assert answer_problem(multi[0], "The answer is: one two and three four", settings) is None


class _InterruptedTeacher(_ScriptedTeacher):
    """Answers its first ``batches`` calls, then stops as Ctrl-C would."""

    def __init__(self, texts, batches):
        super().__init__(texts)
        self.batches = batches

    def generate(self, prompts, **kw):
        if self.batches == 0:
            raise KeyboardInterrupt
        self.batches -= 1
        return super().generate(prompts, **kw)


def test_an_interrupted_teacher_pass_resumes_without_generating_again(tmp_path):
    from ragfix.distill.data import TEACHER_BATCH
    from ragfix.distill.pipeline import teacher_rows

    samples = load_samples(data_file(EVAL_FILE), 10, limit=TEACHER_BATCH + 2)
    texts = [s.answers[0] for s in samples]
    settings = DistillSettings(questions=len(samples))
    run = tmp_path / "run" / "distill_data.json"
    args = (run, True, True, lambda m: None)
    (tmp_path / "run").mkdir()
    with pytest.raises(KeyboardInterrupt):
        teacher_rows(_InterruptedTeacher(texts, batches=1), samples, settings, *args, model_key="a")
    # the rerun asks the teacher only for the questions of the batch that did not finish
    rerun = _ScriptedTeacher(texts[TEACHER_BATCH:])
    kept, rows, report = teacher_rows(rerun, samples, settings, *args, model_key="a")
    (tmp_path / "once").mkdir()
    once = (tmp_path / "once" / "distill_data.json", True, True, lambda m: None)
    assert (kept, rows, report) == teacher_rows(
        _ScriptedTeacher(texts), samples, settings, *once, model_key="a"
    )
    assert report.kept == len(samples)
    # a rerun that asks for fewer questions builds new rows from the stored generations only
    fewer = settings.model_copy(update={"questions": 2})
    kept, _, report = teacher_rows(_ScriptedTeacher([]), samples, fewer, *args, model_key="a")
    assert [s.id for s in kept] == [s.id for s in samples[:2]] and report.kept == 2
    # another model's generations are not reused: every question is asked again
    other = _ScriptedTeacher(["wrong"] * len(samples))
    kept, _, report = teacher_rows(other, samples, fewer, *args, model_key="b")
    assert not kept and report.wrong == len(samples)


def test_truncation_keeps_the_answer_in_the_gold_passage():
    (s,) = load_samples(data_file(EVAL_FILE), 4, limit=1)
    short = shorten_sample(s, 12)
    assert all(len(p.text.split()) <= 12 for p in [short.gold, *short.distractors])
    assert any(a.lower() in short.gold.text.lower() for a in s.answers)


def test_r2_rows_and_two_passage_questions():
    singles = load_samples(data_file(EVAL_FILE), 6, limit=4)
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
    # pairs are formed first; a pair with an excluded member is dropped, the other pair stays
    kept = compose_two_passage(singles, 6, excluded=[singles[1]])
    assert [m.id for m in kept] == [multi[1].id]
    with pytest.raises(ConfigError, match="num_docs >= 3"):
        compose_two_passage(singles, 2)
    kv = singles[0].model_copy(update={"task": "kv"})
    with pytest.raises(DataError, match="task: R2 composes QA samples"):
        compose_two_passage([singles[1], kv], 6)
    assert resolve_anchor(-1, 6) == 5
    with pytest.raises(ConfigError, match="anchor_position 6 out of range"):
        resolve_anchor(6, 6)


def test_training_questions_are_disjoint_from_evaluation_questions():
    eval_samples = load_samples(data_file(EVAL_FILE), 1, limit=40)
    oracle = load_samples(data_file(ORACLE_FILE), 1, limit=260)
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
    _, part, _, _, out = _tiny_run(tmp_path, "resumed", SETTINGS, stop_after=3)
    assert part.steps == 3 and not part.finished
    # the accelerate checkpoint holds only the trainable (LoRA) tensors, plus the run's state
    from safetensors import safe_open

    ckpt = out / CHECKPOINT_DIR
    state = json.loads((ckpt / "ragfix_train_state.json").read_text())
    assert state["step"] == 3 and state["settings"] == SETTINGS.model_dump(mode="json")
    assert state["minutes"] == pytest.approx(part.minutes, abs=0.01)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    lora = [n for n, p in full.named_parameters() if "lora_" in n]
    assert len(keys) == len(lora) == 28 and all("lora_" in k for k in keys)
    # another setting: refused with the setting named, the checkpoint kept
    other = SETTINGS.model_copy(update={"lr": 1e-3})
    with pytest.raises(ConfigError, match=r"other settings \(lr\)"):
        _tiny_run(tmp_path, "resumed", other)
    resumed, res, *_ = _tiny_run(tmp_path, "resumed", SETTINGS)
    assert res.steps == 6 and res.finished
    # the training minutes add up over the two runs (those of steps 1-3 are kept)
    assert res.minutes > state["minutes"] > 0
    # it continued at step 4 (a restart would log 3 + 6 steps) with the same weights
    log = [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5, 6]
    for (n, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n
    # save, then load onto a fresh copy of the same base model: same logits as the trained model
    meta = {"format": "ragfix-pos2distill", "kind": "lora", "variant": "r1"}
    meta["base_model"] = model_identity(tiny_model(seed=1))
    save_adapter(full, tmp_path / "adapter", meta)
    loaded, got = load_adapter(tiny_model(seed=1), tmp_path / "adapter")
    assert got["variant"] == "r1"
    assert _mean_kl(loaded, ex, cache) == pytest.approx(_mean_kl(full, ex, cache), abs=1e-5)
    with pytest.raises(AdapterError, match="adapter was trained on base model"):
        load_adapter(tiny_model("qwen2", seed=1), tmp_path / "adapter")


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


# ------------------------------------------------------------------ distill() end to end, tiny
def _tiny_checkpoint(folder, seed: int):
    """A seeded tiny Llama (2 layers, hidden 64) with the SmolLM2 tokenizer, saved as a model
    folder; returns the model."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ragfix.models.resolve import checkpoint_dir, resolve_model

    tok = AutoTokenizer.from_pretrained(checkpoint_dir(resolve_model("smollm2")))
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def _last_logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], dim=-1)


def test_distill_end_to_end_on_a_tiny_model(tmp_path):
    """`distill()` on a tiny seeded Llama: teacher answers through the backend, two optimiser
    steps, the adapter folder, loading it back, and an interrupted run resuming exactly."""
    from ragfix.backends import load_backend
    from ragfix.metrics import normalize_answer

    folder = tmp_path / "tiny"
    _tiny_checkpoint(folder, seed=0)
    passages = [
        Passage(title=f"Doc {i}", text=f"The river number {i} flows past the old mill town.")
        for i in range(3)
    ]
    draft = QASample(
        id="q0",
        question="which river flows past the mill?",
        answers=["?"],
        gold=passages[0].model_copy(update={"is_gold": True}),
        distractors=passages[1:],
    )
    settings = DistillSettings(
        num_docs=3, questions=1, positions_per_question=2, effective_batch=2, lr=5e-2,
        max_answer_tokens=6, max_answer_words=None, save_every=1,
    )  # fmt: skip
    # a random model answers nonsense: make its own greedy answer the gold answer, so the
    # teacher's answer at the anchor is correct and the question is kept
    teacher = load_backend("vanilla", model=str(folder), device="cpu")
    (g,) = teacher.generate([teacher_prompt(draft, settings)], max_new_tokens=6)
    assert normalize_answer(g.text)
    sample = draft.model_copy(update={"answers": [g.text]})
    del teacher

    logs: list[str] = []
    out = tmp_path / "adapter"
    res, meta = distill(str(folder), [sample], settings, out, device="cpu", log=logs.append)
    assert res.finished and res.steps == res.total_steps == 2  # 3 rows, 2 per step
    assert meta["rows"] == 3 and meta["steps"] == 2 and meta["train_question_ids"] == ["q0"]
    assert meta["kind"] == "lora" and meta["questions_tried"] == 1
    assert meta["teacher_answers"] == TeacherReport(tried=1, kept=1).model_dump()
    assert (out / METADATA_FILE).is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / CHECKPOINT_DIR).exists()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)

    # the adapter loads onto the same base and changes its next-token distribution
    base, tok = load_model(str(folder), device="cpu")
    assert meta["base_model"]["fingerprint"] == model_identity(base)["fingerprint"]
    ids = tok("Question: which river flows past the mill?", add_special_tokens=False)["input_ids"]
    lp_base = _last_logprobs(base, ids)
    adapted, info = load_adapter(load_model(str(folder), device="cpu")[0], out)
    assert info["steps"] == 2 and info["kind"] == "lora" and len(info["fingerprint"]) == 16
    assert (_last_logprobs(adapted, ids) - lp_base).abs().max().item() > 1e-3
    # ... and refuses a differently seeded model of the same shape
    with pytest.raises(AdapterError, match="adapter was trained on base model"):
        load_adapter(_tiny_checkpoint(tmp_path / "other", seed=1), out)

    # interrupted after one step, then rerun: the same adapter as the uninterrupted run
    out2 = tmp_path / "interrupted"
    part, none = distill(
        str(folder), [sample], settings, out2, device="cpu", stop_after=1, log=logs.append
    )
    assert none is None and part.steps == 1 and (out2 / CHECKPOINT_DIR).is_dir()
    logs.clear()
    res2, meta2 = distill(str(folder), [sample], settings, out2, device="cpu", log=logs.append)
    assert res2.steps == 2 and meta2 is not None and any("reusing" in m for m in logs)
    log2 = [json.loads(x)["step"] for x in (out2 / "train_log.jsonl").read_text().splitlines()]
    assert log2 == [1, 2]  # continued at step 2, not restarted
    from safetensors.torch import load_file

    a = load_file(str(out / "adapter_model.safetensors"))
    b = load_file(str(out2 / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_distill_without_a_correct_teacher_answer_is_a_data_error(tmp_path):
    folder = tmp_path / "tiny"
    _tiny_checkpoint(folder, seed=0)
    p = [Passage(title=f"T{i}", text=f"Some text {i}.") for i in range(3)]
    s = QASample(id="q", question="q?", answers=["zzzqqq"], gold=p[0], distractors=p[1:])
    settings = DistillSettings(num_docs=3, questions=1, max_answer_tokens=4)
    with pytest.raises(DataError, match=r"no usable teacher answer among 1 questions \(wrong 1\)"):
        distill(str(folder), [s], settings, tmp_path / "out", device="cpu", log=lambda m: None)


# ------------------------------------------------------------------ real model: CLI and backend
@pytest.fixture(scope="module")
def smol_base():
    """The real SmolLM2-135M-Instruct as ``(model, tokenizer)`` on the CPU (loaded once)."""
    return load_model("smollm2", device="cpu")


@pytest.fixture(scope="module")
def smol_adapter(smol_base, tmp_path_factory):
    """A random (seeded, non-zero) LoRA adapter on the real SmolLM2, saved as `ragfix distill`
    saves one: exercises loading, merging and composition without a training run."""
    from peft import LoraConfig, get_peft_model

    model, _ = smol_base
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(model), cfg)
    out = tmp_path_factory.mktemp("p2d") / "smol-random"
    meta = {"format": "ragfix-pos2distill", "kind": "lora", "variant": "r1"}
    save_adapter(peft_model, out, {**meta, "base_model": model_identity(model)})
    return out


@pytest.mark.slow
def test_cli_trains_a_real_adapter(tmp_path, smol_base):
    """`ragfix distill r1` end to end on SmolLM2: 2 questions, 3 documents, 2 steps."""
    from ragfix.cli.app import app

    out = tmp_path / "smol-r1"
    args = ["distill", "r1", "--train", str(data_file(ORACLE_FILE)), "--out", str(out)]
    args += ["--exclude", str(data_file(EVAL_FILE)), "--offset", "200", "--candidates", "16"]
    args += ["--questions", "2", "--num-docs", "3", "--max-passage-words", "24"]
    args += ["--positions-per-question", "2", "--effective-batch", "3", "--lr", "5e-3"]
    args += ["--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "adapter written" in res.output and f"--adapter {out}" in res.output
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["base_model"]["fingerprint"] == model_identity(smol_base[0])["fingerprint"]
    assert len(meta["train_question_ids"]) == 2 and meta["rows"] == 6 and meta["steps"] == 2
    assert len(meta["excluded_question_ids"]) == 200
    assert not set(meta["train_question_ids"]) & set(meta["excluded_question_ids"])
    assert meta["settings"]["num_docs"] == 3 and meta["kind"] == "lora"
    assert (out / "adapter_model.safetensors").exists() and not (out / CHECKPOINT_DIR).exists()


def test_adapter_merged_unmerged_and_under_gali(smol_adapter, smol_base):
    """The adapter as a load option: merged by `load_backend` equals peft's unmerged model,
    changes the base model, and runs under GALI (unmodified inside the trained window)."""
    from peft import PeftModel

    from ragfix.backends import load_backend
    from ragfix.backends.hf import HFBackend
    from ragfix.prompts import TaskPrompt

    model, tok = smol_base
    prompt = TaskPrompt(user="Question: who wrote hamlet?\nAnswer:")
    merged = load_backend("pos2distill", device="cpu", adapter=str(smol_adapter))
    unmerged = HFBackend(PeftModel.from_pretrained(copy.deepcopy(model), smol_adapter), tok)
    (lp_m,), (lp_u,) = merged.next_token_logprobs([prompt]), unmerged.next_token_logprobs([prompt])
    (lp_v,) = HFBackend(model, tok).next_token_logprobs([prompt])
    assert torch.allclose(lp_m, lp_u, atol=1e-4)
    assert (lp_m - lp_v).abs().max().item() > 1e-3  # the adapter changes the model
    assert merged.identity()["adapter"]["variant"] == "r1"
    gali = load_backend("gali", device="cpu", adapter=str(smol_adapter), noise=False)
    ident = gali.identity()
    assert ident["backend"] == "gali" and ident["adapter"] == merged.identity()["adapter"]
    # a prompt inside the trained window runs unmodified under GALI: same as the merged adapter
    (lp_g,) = gali.next_token_logprobs([prompt])
    assert torch.allclose(lp_g, lp_m, atol=1e-4)
    (g,) = merged.generate([prompt], max_new_tokens=8)
    assert g.new_tokens >= 1


def test_backend_refuses_an_adapter_of_another_base_model(tmp_path, smol_base):
    from peft import LoraConfig, get_peft_model

    from ragfix.backends import load_backend

    tiny = tiny_model(seed=3)
    meta = {"format": "ragfix-pos2distill", "kind": "lora", "variant": "r1"}
    meta["base_model"] = model_identity(tiny)
    save_adapter(get_peft_model(tiny, LoraConfig(r=2, target_modules="all-linear")), tmp_path, meta)
    with pytest.raises(AdapterError, match="adapter was trained on base model"):
        load_backend("vanilla", device="cpu", adapter=str(tmp_path))
    with pytest.raises(AdapterError, match="not an adapter folder"):
        load_adapter(copy.deepcopy(smol_base[0]), tmp_path / "nope")
