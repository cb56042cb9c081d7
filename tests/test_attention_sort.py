"""The ``attention-sort`` backend: passage attention against a by-hand computation (one full
eager pass, no cache split) on tiny seeded models; the calibrated score; the sorted prompt on
real KV data read by the real SmolLM2; answers that are vanilla's on the sorted prompt;
reordering a task prompt; refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import BUNDLED, tiny_folder, tiny_model, wide_passages_prompt

from ragfix.backends.attention_sort import (
    PLACE_DEFAULTS,
    AttentionSortBackend,
    AttentionSortOptions,
    default_place,
    passage_attention,
    passage_scores,
    sort_passages,
)
from ragfix.backends.hf import chat_text
from ragfix.connectors.litm import load_samples
from ragfix.errors import RagfixError, UnsupportedModelError
from ragfix.prompts import TaskPrompt
from ragfix.tasks import get_task, task_prompt
from ragfix.types import Passage

KV = BUNDLED / "kv_16pairs_sample.jsonl.gz"
DOCS = [
    Passage(title="Cats", text="Cats sleep a lot."),
    Passage(title="Berlin", text="Berlin is the capital of Germany."),
    Passage(title="Nile", text="The Nile is a river."),
]


def test_reordered_moves_each_passage_with_its_label():
    p = get_task("qa").prompt("What is the capital of Germany?", DOCS)
    r = p.reordered([2, 0, 1])
    head = p.user[: p.passages[0][0]]
    assert r.user == (
        head + "Document [3](Title: Nile) The Nile is a river.\n"
        "Document [1](Title: Cats) Cats sleep a lot.\n"
        "Document [2](Title: Berlin) Berlin is the capital of Germany."
        "\n\nQuestion: What is the capital of Germany?\nAnswer:"
    )
    assert r.passage_texts() == [p.passage_texts()[i] for i in (2, 0, 1)]
    assert r.no_query.passage_texts() == [p.no_query.passage_texts()[i] for i in (2, 0, 1)]
    assert "Question: N/A" in r.no_query.user and r.no_content == p.no_content
    assert p.reordered([0, 1, 2]) == p
    with pytest.raises(ValueError, match="not a permutation"):
        p.reordered([0, 0, 1])


def test_content_free_forms_keep_the_template():
    p = get_task("kv").prompt(
        "k1", [Passage(title="k0", text="v0"), Passage(title="k1", text="v1")]
    )
    assert p.no_query.user == p.user.replace('Key: "k1"', 'Key: "N/A"')
    assert p.no_query.passages == p.passages
    assert p.no_query.assistant_prefix == 'The value of key "N/A" is "'
    assert p.no_content.passage_texts() == ['"": ""', '"": ""']


def _by_hand(model, tokenizer, prompt: TaskPrompt) -> torch.Tensor:
    """One eager pass over the whole text with every attention weight returned; per layer the
    mean over heads and reader tokens of the attention summed over each passage's tokens."""
    text = chat_text(tokenizer, prompt)
    offset = text.find(prompt.user)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [a for a, _ in enc["offset_mapping"]]
    spans = [(offset + a, offset + b) for a, b in prompt.passages]
    readers = [t for t, c in enumerate(starts) if c >= spans[-1][1]]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([enc["input_ids"]]), output_attentions=True)
    rows = []
    for layer in out.attentions:
        per = []
        for a, b in spans:
            cols = [t for t, c in enumerate(starts) if a <= c < b]
            total = 0.0
            for h in range(layer.shape[1]):
                for r in readers:
                    total += float(layer[0, h, r, cols].sum())
            per.append(total / (layer.shape[1] * len(readers)))
        rows.append(per)
    return torch.tensor(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_passage_attention_equals_a_by_hand_computation(smol, arch):
    model = tiny_model(arch, seed=4, vocab_size=len(smol.tokenizer), num_hidden_layers=3)
    backend = AttentionSortBackend(model, smol.tokenizer)
    prompt = get_task("qa").prompt("Which river?", DOCS)
    got = passage_attention(backend, prompt)
    want = _by_hand(model, smol.tokenizer, prompt)
    assert got.shape == (3, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert bool((got > 0).all()) and bool((got.sum(-1) < 1).all())
    # calibrated, upper layers: the reading minus the content-free query's, layers 1..2
    # (the content-free query reads the passages' KV cache the query's read prefilled: one
    # prefill of the passages, then each query's readers)
    lengths = []
    forward = model.forward
    model.forward = lambda *a, **kw: lengths.append(kw["input_ids"].shape[1]) or forward(*a, **kw)
    cal = passage_scores(backend, prompt, AttentionSortOptions(calibrate=True))
    del model.forward
    free = _by_hand(model, smol.tokenizer, prompt.no_query)
    torch.testing.assert_close(cal, (want - free)[1:].mean(0), atol=1e-5, rtol=1e-4)
    ids = smol.tokenizer(backend.format_prompt(prompt), add_special_tokens=False)["input_ids"]
    assert len(lengths) == 3 and lengths[0] + lengths[1] == len(ids)


def test_a_layer_whose_window_misses_a_passage_is_not_read(smol):
    """Gemma 3 (a local layer with a 128-token window, then a full one) and Mistral (every layer
    local): on a prompt whose passages start more than a window before its last token, the
    local layer's row is NaN, the full layer's equals the by-hand pass, and the score is the
    full layer's alone; a prompt that no layer sees whole is refused in one line (the family's
    refusal); a prompt inside the window reads every layer, by hand too."""
    from ragfix.backends.attention_sort import combine_scores
    from ragfix.eval.families import TINY_WINDOW, tiny_family_model

    long = wide_passages_prompt()
    ids = smol.tokenizer(chat_text(smol.tokenizer, long), add_special_tokens=False)["input_ids"]
    assert len(ids) > TINY_WINDOW + 50
    gemma = AttentionSortBackend(
        tiny_family_model("gemma3", smol.tokenizer, attn="eager", seed=3), smol.tokenizer
    )
    got = passage_attention(gemma, long)
    want = _by_hand(gemma.model, smol.tokenizer, long)
    assert bool(got[0].isnan().all()) and not bool(got[1].isnan().any())
    assert float(want[0, 0]) == 0.0  # the local layer's readers do not see the first passage
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4)
    free = passage_attention(gemma, long.no_query)
    for layers in ("upper", "all"):
        opts = AttentionSortOptions(layers=layers, calibrate=True)
        torch.testing.assert_close(combine_scores(got, free, opts), got[1] - free[1])
    # a model whose only full layer is below the upper half: upper reads none, all reads it
    lower_only = torch.stack([got[1], got[0]])
    with pytest.raises(RagfixError, match="layers=upper: none of these layers sees every"):
        combine_scores(lower_only, None, AttentionSortOptions(layers="upper", calibrate=False))
    opts = AttentionSortOptions(layers="all", calibrate=False)
    torch.testing.assert_close(combine_scores(lower_only, None, opts), got[1])
    assert gemma.identity()["sliding_rule"] == AttentionSortBackend.sliding_rule
    assert "sliding_rule" not in AttentionSortBackend(smol.model, smol.tokenizer).identity()

    mistral = AttentionSortBackend(
        tiny_family_model("mistral", smol.tokenizer, attn="eager", seed=3), smol.tokenizer
    )
    with pytest.raises(UnsupportedModelError) as err:
        mistral.generate([long])
    assert str(err.value).startswith("attention-sort does not support Mistral (mistral): every ")
    assert f"(at most {TINY_WINDOW} tokens)" in str(err.value) and "\n" not in str(err.value)
    short = get_task("qa").prompt("Which river?", DOCS)
    torch.testing.assert_close(
        passage_attention(mistral, short),
        _by_hand(mistral.model, smol.tokenizer, short),
        atol=1e-5,
        rtol=1e-4,
    )


def test_the_gold_pair_goes_last_on_real_kv(smol):
    """Real KV records, the real SmolLM2: the default (upper layers, one round) puts the gold
    pair last from every position of 4 pairs, and the answer is vanilla's on that order."""
    backend = AttentionSortBackend(smol.model, smol.tokenizer)
    for sample in load_samples(KV, 4, 1):
        gold = task_prompt(sample, [sample.gold]).passage_texts()[0]
        for pos in range(4):
            prompt = task_prompt(sample, sample.passages_with_gold_at(pos))
            order, history = sort_passages(backend, prompt, backend.options)
            assert order[-1] == pos and len(history) == 1
            assert backend.sorted_prompt(prompt).passage_texts()[-1] == gold
    sorted_prompt = backend.sorted_prompt(prompt)
    assert backend.encode(prompt) == smol.encode(sorted_prompt)
    assert smol.model.config._attn_implementation == "sdpa"
    got = backend.generate([prompt])[0]
    want = smol.generate([sorted_prompt])[0]
    assert got.text == want.text and sample.answers[0] in got.text


def test_place_first_puts_the_most_attended_first_and_is_gemmas_default(smol):
    """``place=first`` is the descending order of the same scores (the gold pair first on real
    KV records); ``place`` left unset resolves to the model's measured default
    (:data:`PLACE_DEFAULTS`: ``first`` for Gemma 3 270M, ``last`` for any other model), and
    the value used is in the backend's identity."""
    last = AttentionSortBackend(smol.model, smol.tokenizer)
    first = AttentionSortBackend(smol.model, smol.tokenizer, place="first")
    assert last.identity()["options"]["place"] == "last"
    assert first.identity()["options"]["place"] == "first"
    for sample in load_samples(KV, 4, 1):
        for pos in range(4):
            prompt = task_prompt(sample, sample.passages_with_gold_at(pos))
            order, [scores] = sort_passages(first, prompt, first.options)
            assert order[0] == pos
            assert order == sorted(range(4), key=lambda i: -scores[i])
            assert sort_passages(last, prompt, last.options)[0] == order[::-1]
    assert default_place("gemma3-270m") == default_place("google/gemma-3-270m") == "first"
    assert default_place("smollm2") == "last" and PLACE_DEFAULTS.keys() >= {"gemma3-270m"}
    name = smol.model.ragfix_name
    smol.model.ragfix_name = "gemma3-270m"  # the same weights named as Gemma: its default
    try:
        gemma_named = AttentionSortBackend(smol.model, smol.tokenizer)
        assert gemma_named.options.place == "first"
    finally:
        smol.model.ragfix_name = name


def test_rounds_read_the_order_the_previous_round_left(smol):
    backend = AttentionSortBackend(smol.model, smol.tokenizer, rounds=2)
    prompt = get_task("qa").prompt("What is the capital of Germany?", DOCS)
    order, history = sort_passages(backend, prompt, backend.options)
    assert len(history) == 2 and sorted(order) == [0, 1, 2]
    first = sorted(range(3), key=lambda i: history[0][i])
    again = passage_scores(backend, prompt.reordered(first), backend.options).tolist()
    assert [again[first.index(i)] for i in range(3)] == pytest.approx(history[1], rel=1e-5)
    assert order == sorted(range(3), key=lambda i: history[1][i])


def test_refusals(smol):
    backend = AttentionSortBackend(smol.model, smol.tokenizer, calibrate=True)
    for prompt in ("a plain text", TaskPrompt(user="no passages")):
        with pytest.raises(RagfixError, match="does not say where they are") as err:
            backend.generate([prompt])
        assert "\n" not in str(err.value)
    bare = get_task("qa")._prompt("Which river?", DOCS)  # spans, no content-free forms
    with pytest.raises(RagfixError, match="content-free query"):
        backend.encode(bare)
    with pytest.raises(ValueError):
        AttentionSortOptions(rounds=0)
    one = get_task("qa").prompt("Which river?", DOCS[:1])
    assert sort_passages(backend, one, backend.options) == ([0], [])


def test_the_sweep_answers_the_sorted_prompts(smol):
    """Through the sweep (its fit check, then generation with prefix reuse): at every gold
    position the answer is vanilla's on the sorted prompt, the gold value is found, and the
    record keeps the sorted prompt with the gold passage's place in it."""
    from ragfix.eval.sweep import SweepConfig, plan_cells, run_cells

    backend = AttentionSortBackend(smol.model, smol.tokenizer)
    sample = load_samples(KV, 4, 1)[0]
    config = SweepConfig(
        data="kv", task="kv", num_docs=4, model="smollm2", backend="attention-sort"
    )
    records = {}
    cells = plan_cells(config, [sample], list(range(4)))
    run_cells(backend, cells, lambda r: records.__setitem__(r.position, r), batch_size=4)
    for pos in range(4):
        sorted_prompt = backend.sorted_prompt(
            task_prompt(sample, sample.passages_with_gold_at(pos))
        )
        assert records[pos].answer == smol.generate([sorted_prompt])[0].text
        assert records[pos].correct
        # the record keeps the prompt the model read: the sorted one, the gold passage found in it
        kept = records[pos].prompt
        assert kept.text == sorted_prompt.user and kept.passages == list(sorted_prompt.passages)
        start, end = sorted_prompt.passages[kept.gold]
        assert sample.answers[0] in sorted_prompt.user[start:end]
        assert records[pos].prompt_position == kept.gold


def test_forget_prompts_drops_the_memoised_sorts(smol, monkeypatch):
    import ragfix.backends.attention_sort.backend as scorer

    backend = AttentionSortBackend(smol.model, smol.tokenizer, calibrate=False)
    prompt = get_task("qa").prompt("Which river?", DOCS)
    reads = []
    real = scorer.passage_attention
    monkeypatch.setattr(scorer, "passage_attention", lambda b, p: reads.append(p) or real(b, p))
    backend.encode(prompt)
    backend.encode(prompt)  # memoised: no second read
    assert len(reads) == 1
    backend.forget_prompts()
    backend.encode(prompt)
    assert len(reads) == 2


def test_a_prompt_over_the_window_is_flagged_before_any_attention_pass(tmp_path):
    """Issue 45: through the sweep, a prompt that does not fit the window (16 KV pairs, 1262
    tokens, in a 512-token window) is flagged ``overflow`` on its tokens as given, as vanilla
    flags it, without one forward pass of the model (the attention pass read the whole prompt
    first); a prompt that fits is still read, sorted and counted as sorted."""
    from ragfix.backends import load_backend
    from ragfix.eval.sweep import SweepConfig, plan_cells, run_cells
    from ragfix.types import OVERFLOW

    folder = tiny_folder(tmp_path / "tiny", window=512)
    sort = load_backend("attention-sort", model=str(folder), device="cpu")
    vanilla = load_backend("vanilla", model=str(folder), device="cpu")
    passes = []
    hook = sort.model.register_forward_hook(lambda *args: passes.append(1))
    try:
        long = load_samples(KV, 16, 1)[0]
        config = SweepConfig(data="kv", task="kv", num_docs=16, model=str(folder),
                             backend="attention-sort")  # fmt: skip
        cells = plan_cells(config, [long], [0, 8, 15])
        flagged, reference = [], []
        run_cells(sort, cells, flagged.append)
        assert passes == []
        run_cells(vanilla, cells, reference.append)
        assert [r.flags for r in flagged] == [r.flags for r in reference]
        assert all(OVERFLOW in r.flags and r.new_tokens == 0 for r in flagged)
        counted = [len(vanilla.encode(task_prompt(long, long.passages_with_gold_at(p))))
                   for p in (0, 8, 15)]  # fmt: skip
        assert [r.prompt_tokens for r in flagged] == counted
        assert min(counted) > 512
        # a prompt that fits: the attention pass runs, the verdict counts the sorted prompt
        short = load_samples(KV, 4, 1)[0]
        prompt = task_prompt(short, short.passages_with_gold_at(1))
        fit = sort.fit(prompt)
        assert passes and fit.flag is None
        assert fit.prompt_tokens == len(vanilla.encode(sort.sorted_prompt(prompt)))
    finally:
        hook.remove()


def test_the_tune_scores_each_variant_by_its_top_passage(tmp_path):
    """``ragfix tune attention-sort``'s table: a hit is a cell whose most attended passage (by
    the variant's combined scores) is the gold passage; the default has the best worst
    position. On a tiny Qwen3 (seed 1: its query and key norms make its attention peaked)
    whose variants score the gold passage highest in some cells and not in others."""
    from ragfix.backends import load_backend
    from ragfix.backends.attention_sort.backend import combine_scores, passage_attention
    from ragfix.backends.attention_sort.tune import VARIANTS, tune_attention_sort, variant_name

    folder = tiny_folder(tmp_path / "qwen3", seed=1, arch="qwen3")
    backend = load_backend("vanilla", model=str(folder), device="cpu")
    samples = load_samples(BUNDLED / "kv_16pairs_sample.jsonl.gz", 4, limit=1)
    table, details = tune_attention_sort(backend, samples, [0, 3])
    prompt = task_prompt(samples[0], samples[0].passages_with_gold_at(3))
    att = passage_attention(backend, prompt)
    free = passage_attention(backend, prompt.no_query)
    for v in VARIANTS:
        top = int(combine_scores(att, free, v).argmax())
        assert details["hits"][variant_name(v)][1] == int(top == 3)
    assert {h[1] for h in details["hits"].values()} == {0, 1}
    default = [r for r in table.rows if r[0].endswith("(default)")]
    assert len(default) == 1 and default[0][0] == details["default"] + " (default)"
    rates = {n: min(h) for n, h in details["hits"].items()}
    assert rates[details["default"]] == max(rates.values()) > min(rates.values())


def test_the_rounds_tune_gives_where_each_number_of_rounds_places_the_gold_pair(tmp_path):
    """``tune_rounds``: after round r, a hit is a cell whose sort of r rounds (the backend's own
    order, computed here for each r apart) puts the gold pair where ``place`` puts the most
    attended; the default has the best worst position. On a tiny Qwen3 (seed 4: its query and
    key norms make its attention peaked), whose sorts place the gold pair in some cells and
    rounds and not in others, and whose default is one round for one ``place`` and two for the
    other."""
    from ragfix.backends import load_backend
    from ragfix.backends.attention_sort.backend import sort_passages
    from ragfix.backends.attention_sort.tune import tune_rounds

    folder = tiny_folder(tmp_path / "qwen3", seed=4, arch="qwen3")
    backend = load_backend("vanilla", model=str(folder), device="cpu")
    samples = load_samples(BUNDLED / "kv_16pairs_sample.jsonl.gz", 4, limit=3)
    defaults = set()
    for place in ("last", "first"):
        options = AttentionSortOptions(layers="all", rounds=2, place=place)
        table, details = tune_rounds(backend, samples, [0, 3], options)
        for cell in details["cells"]:
            [sample] = [s for s in samples if s.id == cell["sample"]]
            prompt = task_prompt(sample, sample.passages_with_gold_at(cell["position"]))
            for r in (1, 2):
                opts = options.model_copy(update={"rounds": r})
                order, _ = sort_passages(backend, prompt, opts)
                spot = order[-1] if place == "last" else order[0]
                assert cell["placed"][r - 1] == (spot == cell["position"])
        hits = [
            [sum(c["placed"][r] for c in details["cells"] if c["position"] == p) for p in (0, 3)]
            for r in (0, 1)
        ]
        assert details["hits"] == hits and [row[0] for row in table.rows][0].startswith("rounds=1")
        best = max((min(h), sum(h), -r) for r, h in enumerate(hits))
        assert details["default"] == f"rounds={-best[2] + 1}"
        placed = [p for c in details["cells"] for p in c["placed"]]
        assert any(placed) and not all(placed)
        defaults.add(details["default"])
    assert defaults == {"rounds=1", "rounds=2"}


def test_the_tune_command_reads_the_records_as_the_task_given(tmp_path):
    """``ragfix tune attention-sort --task``: the cells are the task's prompts (the scores of
    ``qa-extractive``'s prompt, recomputed here), the task is in the result file, and a task of
    another data format is refused in one line. On a tiny Qwen3 (seed 5) whose variants score
    the gold passage highest or not, and for one variant otherwise on plain ``qa``'s prompt."""
    import json

    from typer.testing import CliRunner

    from ragfix.backends import load_backend
    from ragfix.backends.attention_sort.backend import combine_scores, passage_attention
    from ragfix.backends.attention_sort.tune import VARIANTS, variant_name
    from ragfix.cli.app import app

    model = str(tiny_folder(tmp_path / "qwen3", seed=5, arch="qwen3"))
    out = tmp_path / "tune.json"
    args = ["tune", "attention-sort", "nq-sample", "--records", "0:1", "--num-docs", "3"]
    args += ["--model", model]
    res = CliRunner().invoke(
        app, [*args, "--positions", "2", "--task", "qa-extractive", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    details = json.loads(out.read_text())
    assert details["task"] == "qa-extractive"
    [sample] = load_samples(BUNDLED / "nq_10docs_sample.jsonl.gz", 3, 1, task="qa-extractive")
    prompt = task_prompt(sample, sample.passages_with_gold_at(2))
    plain = sample.model_copy(update={"task": "qa"})
    plain = task_prompt(plain, plain.passages_with_gold_at(2))
    assert prompt.user != plain.user
    backend = load_backend("vanilla", model=model, device="cpu")

    def hits(prompt):
        att, free = passage_attention(backend, prompt), passage_attention(backend, prompt.no_query)
        return {
            variant_name(v): [int(combine_scores(att, free, v).argmax() == 2)] for v in VARIANTS
        }

    assert details["hits"] == hits(prompt) != hits(plain)
    assert {h[0] for h in details["hits"].values()} == {0, 1}
    res = CliRunner().invoke(app, [*args, "--positions", "2", "--task", "kv"])
    assert res.exit_code == 2 and res.output.strip().startswith("error: --task kv reads kv")
    # --rounds: a second table, the default variant sorted that many rounds, in the result file
    more = ["--positions", "2", "--rounds", "2", "--place", "last", "--json", str(out)]
    res = CliRunner().invoke(app, [*args, *more])
    assert res.exit_code == 0, res.output
    details = json.loads(out.read_text())
    assert [len(c["placed"]) for c in details["rounds"]["cells"]] == [2]
    assert details["more_tables"][0]["title"].endswith("gold passage placed last")
    res = CliRunner().invoke(app, [*args, "--rounds", "2", "--place", "middle"])
    assert res.exit_code == 2 and "place" in res.output and "Traceback" not in res.output
