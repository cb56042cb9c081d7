import pytest

from ragfix.metrics import (
    best_subspan_em,
    kv_match,
    normalize_answer,
    position_curve,
    wilson_interval,
)


def test_normalize_answer_squad_rules():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"


@pytest.mark.parametrize(
    "pred,answers,expected",
    [
        ("Wilhelm Conrad Röntgen won it.", ["Wilhelm Conrad Röntgen"], True),
        ("wilhelm conrad röntgen", ["Wilhelm Conrad Röntgen"], True),
        ("Röntgen", ["Wilhelm Conrad Röntgen"], False),  # gold must be inside the prediction
        ("In 1990.", ["1"], True),  # character-level substring, as Lost in the Middle scores
        ("Paris\nThe answer is London", ["London"], False),  # first line only
        ("  \nParis", ["Paris"], False),
        ("The Beatles", ["Beatles", "The Rolling Stones"], True),
    ],
)
def test_best_subspan_em(pred, answers, expected):
    assert best_subspan_em(pred, answers) is expected


def test_kv_match_whole_output_case_insensitive():
    assert kv_match('x\nThe value is "ABC-1"', "abc-1")
    assert not kv_match("abc-2", "abc-1")


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4)
    assert hi == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(0, 5)[0] == 0.0


def test_position_curve_summary():
    pairs = [(0, True), (0, True), (1, False), (1, True), (2, False), (2, False)]
    c = position_curve(pairs)
    assert [s.accuracy for s in c.positions] == [1.0, 0.5, 0.0]
    assert c.mean == pytest.approx(0.5)
    assert (c.best_position, c.worst_position, c.gap) == (0, 2, 1.0)
    with pytest.raises(ValueError):
        position_curve([])
