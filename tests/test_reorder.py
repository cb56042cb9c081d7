"""Reorder strategies (pure placements, bias profiles, attention sorting) and the corrections."""

from __future__ import annotations

import json

import pytest

from ragfix.errors import ConfigError
from ragfix.eval.sweep_summary import build_summary
from ragfix.pruning import BudgetError, drop_near_duplicates, fit_budget
from ragfix.reorder import (
    ProfileError,
    attention_sort_order,
    bias_profile_order,
    load_profile,
    lost_in_the_middle_order,
    reverse_order,
    static_order,
)
from ragfix.tasks import get_task
from ragfix.types import Passage


@pytest.mark.parametrize(
    "n, expected",
    [
        (1, [0]),
        (2, [0, 1]),
        (3, [0, 2, 1]),
        (4, [0, 2, 3, 1]),
        (5, [0, 2, 4, 3, 1]),
        (6, [0, 2, 4, 5, 3, 1]),
        (10, [0, 2, 4, 6, 8, 9, 7, 5, 3, 1]),
    ],
)
def test_lost_in_the_middle_is_stable_and_u_shaped(n, expected):
    order = lost_in_the_middle_order(n)
    assert order == expected
    assert order[0] == 0  # rank 0 first for odd and even counts
    if n > 1:
        assert order[-1] == 1  # second best at the other end


def test_none_and_reverse():
    assert static_order("none", 4) == [0, 1, 2, 3]
    assert reverse_order(5) == [4, 3, 2, 1, 0]
    assert static_order("reverse", 3) == [2, 1, 0]


def test_bias_profile_puts_best_rank_at_most_accurate_position():
    acc = [0.8, 0.3, 0.5, 0.5, 0.9]
    order = bias_profile_order(acc)
    # positions by accuracy: 4 (0.9), 0 (0.8), 2 (0.5, earlier tie first), 3 (0.5), 1 (0.3)
    assert order == [1, 4, 2, 3, 0]
    assert order[4] == 0 and order[1] == 4
    assert sorted(order) == list(range(5))


def _summary_file(tmp_path, model="smollm2", num_docs=4, accs=(0.9, 0.4, 0.5, 0.7)):
    records = []
    for pos, acc in enumerate(accs):
        for i in range(10):
            correct = i < round(acc * 10)
            records.append(
                {"cell_id": f"{pos}-{i}", "backend": "vanilla", "position": pos, "correct": correct}
            )
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "num_docs": num_docs}))
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(build_summary(tmp_path, records)))
    return path


def test_load_profile_from_a_real_summary(tmp_path):
    path = _summary_file(tmp_path)
    acc = load_profile(path, model="smollm2", num_docs=4)
    assert acc == pytest.approx([0.9, 0.4, 0.5, 0.7])
    assert static_order("bias-profile", 4, acc) == [0, 3, 2, 1]


def test_profile_of_another_model_or_size_is_refused(tmp_path):
    path = _summary_file(tmp_path)
    with pytest.raises(ProfileError, match="model 'smollm2', not 'llama'"):
        load_profile(path, model="llama", num_docs=4)
    with pytest.raises(ProfileError, match="for 4 documents, not 10"):
        load_profile(path, model="smollm2", num_docs=10)
    with pytest.raises(ProfileError, match="covers 4 documents but 5"):
        static_order("bias-profile", 5, [0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ProfileError, match="not a ragfix summary"):
        load_profile(tmp_path / "config.json")
    assert load_profile([0.2, 0.6]) == [0.2, 0.6]


def test_unknown_strategy():
    with pytest.raises(ConfigError, match="unknown reorder strategy 'middle'"):
        static_order("middle", 3)


def test_near_duplicates_keep_the_higher_ranked_copy():
    texts = [
        "The Eiffel Tower is in Paris and was built in 1889 for the fair.",
        "Berlin is the capital of Germany.",
        "The Eiffel Tower is in Paris and was built in 1889 for the fair!",
        "Cats sleep a lot.",
    ]
    assert drop_near_duplicates(texts) == [0, 1, 3]
    assert drop_near_duplicates(texts, threshold=1.0) == [0, 1, 3]  # identical word 3-grams
    assert drop_near_duplicates(texts[:2] + texts[3:]) == [0, 1, 2]


def test_budget_drops_lowest_ranked_whole_passages(smol):
    texts = ["Paris is the capital of France. " * 3, "Berlin is in Germany. " * 3, "Cats. " * 20]
    sizes = [smol.count_tokens(t) for t in texts]
    assert fit_budget(texts, sum(sizes), smol.count_tokens) == [0, 1, 2]
    assert fit_budget(texts, sizes[0] + sizes[1], smol.count_tokens) == [0, 1]
    assert fit_budget(texts, sizes[0], smol.count_tokens) == [0]
    with pytest.raises(BudgetError, match=f"best passage has {sizes[0]} tokens"):
        fit_budget(texts, sizes[0] - 1, smol.count_tokens)


PASSAGES = [
    Passage(title="Cats", text="Cats are small furry animals that sleep a lot."),
    Passage(title="Berlin", text="Berlin is the capital of Germany."),
    Passage(title="Rivers", text="The Nile is a long river in Africa."),
]


def test_attention_sort_reads_the_task_prompt(smol):
    """The strategy sorts the sweep's own prompt for that order with the backend's scorer."""
    from ragfix.backends.attention_sort import AttentionSortOptions, passage_scores

    q = "What is the capital of Germany?"
    order, history = attention_sort_order(smol, q, PASSAGES, rounds=2)
    assert sorted(order) == [0, 1, 2] and len(history) == 2
    prompt = get_task("qa").prompt(q, PASSAGES)
    raw = AttentionSortOptions(calibrate=False)  # the strategy's attention-sort
    first = passage_scores(smol, prompt, raw).tolist()
    assert first == pytest.approx(history[0], rel=1e-5)
    for round_mass in history:
        assert all(0 < m < 1 for m in round_mass) and sum(round_mass) < 1
    # the second round read the first round's order; the final order sorts its scores ascending
    second = history[1]
    assert [second[r] for r in order] == sorted(second)
    assert smol.model.config._attn_implementation == "sdpa"  # restored after reading attention
    # calibrated: minus the content-free query's attention to the same passages
    _, cal = attention_sort_order(smol, q, PASSAGES, rounds=1, calibrate=True)
    free = passage_scores(smol, prompt.no_query, raw).tolist()
    assert cal[0] == pytest.approx([a - b for a, b in zip(first, free, strict=True)], abs=1e-6)
    with pytest.raises(ConfigError, match="at least one round"):
        attention_sort_order(smol, q, PASSAGES, rounds=0)
    with pytest.raises(ConfigError, match="'upper' or 'all'"):
        attention_sort_order(smol, q, PASSAGES, layers="lower")


@pytest.mark.parametrize("strategy", ["none", "reverse", "lost-in-the-middle", "bias-profile"])
def test_no_or_one_passage_needs_no_placement(strategy):
    """Nothing to place: [] and [0] whatever the profile's length (a 4-position profile here)."""
    profile = [0.1, 0.9, 0.5, 0.3]
    assert static_order(strategy, 0, profile) == []
    assert static_order(strategy, 1, profile) == [0]
    with pytest.raises(ProfileError, match="covers 4 documents but 2"):
        static_order("bias-profile", 2, profile)


def test_attention_sort_of_one_passage_reads_nothing(smol, monkeypatch):
    import ragfix.backends.attention_sort.backend as scorer

    monkeypatch.setattr(scorer, "passage_attention", lambda *a: pytest.fail("model read"))
    assert attention_sort_order(smol, "Where is Berlin?", PASSAGES[:1]) == ([0], [])
    assert attention_sort_order(smol, "Where is Berlin?", []) == ([], [])
