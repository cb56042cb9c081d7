import gzip
import json
import math
import re
import string
import time
import unicodedata

import pytest
from conftest import BUNDLED, data_file

from ragfix.errors import RagfixError
from ragfix.metrics import (
    best_subspan_em,
    degenerate_gold,
    kv_match,
    mcnemar_exact,
    normalize_answer,
    paired_comparison,
    position_curve,
    score_normalize,
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


COMPOSED = "Beyonc\u00e9"  # "Beyoncé", e with acute as one code point
DECOMPOSED = "Beyonce\u0301"  # e, then the combining acute accent


def test_decomposed_and_composed_unicode_match_both_ways():
    assert COMPOSED != DECOMPOSED and unicodedata.normalize("NFC", DECOMPOSED) == COMPOSED
    assert score_normalize(DECOMPOSED) == score_normalize(COMPOSED) == "beyonc\u00e9"
    assert best_subspan_em(DECOMPOSED, [COMPOSED]) is True
    assert best_subspan_em(COMPOSED, [DECOMPOSED]) is True
    assert best_subspan_em(f"It was {DECOMPOSED} Knowles.", [f"{COMPOSED} Knowles"]) is True
    assert best_subspan_em(f"The singer {COMPOSED}", [f"{DECOMPOSED} Knowles"]) is False
    # the SQuAD step alone leaves the two spellings apart: the NFC step is what matches them
    assert normalize_answer(DECOMPOSED) != normalize_answer(COMPOSED)


def _litm_normalize(s: str) -> str:
    """Lost in the Middle's ``normalize_answer`` (nelson-liu/lost-in-the-middle,
    ``src/lost_in_the_middle/metrics.py``): lower, drop punctuation, drop articles, fold
    white space; no Unicode normalisation."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


#: the Lost-in-the-Middle-format files (``data/`` and the package samples) and how many gold
#: answers each holds (QA: every entry of ``answers``; KV: the ``value``)
GOLD_FILES = {
    "litm_nq_open_oracle.jsonl.gz": 3519,
    "derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz": 337,
    "derived_nq_20docs_bm25pool_gold_at_9.jsonl.gz": 337,
    "litm_kv_retrieval_75_keys.jsonl.gz": 500,
    "litm_kv_retrieval_140_keys.jsonl.gz": 400,
    "bundled:nq_10docs_sample.jsonl.gz": 99,
    "bundled:kv_16pairs_sample.jsonl.gz": 60,
    "bundled:nq_demo_questions.jsonl": 709,
}


def _golds(name: str) -> list[str]:
    path = BUNDLED / name.split(":", 1)[1] if name.startswith("bundled:") else data_file(name)
    if not path.exists():
        pytest.fail(f"data file not available: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            out += rec["answers"] if "answers" in rec else [rec["value"]]
    return out


def test_nfc_leaves_every_gold_answer_of_the_litm_files_as_it_was():
    """Every gold answer of the shipped Lost-in-the-Middle files normalises to the same string
    with and without the NFC step (and as Lost in the Middle's own code does), so every score
    on these files is unchanged."""
    start = time.perf_counter()
    checked, accented = {}, 0
    for name in GOLD_FILES:
        golds = _golds(name)
        for a in golds:
            litm = _litm_normalize(a)
            assert normalize_answer(a) == litm, (name, a)
            assert score_normalize(a) == litm, (name, a)
            accented += not a.isascii()
        checked[name] = len(golds)
    assert checked == GOLD_FILES and sum(checked.values()) == 5961
    assert accented == 158  # "Wilhelm Conrad Röntgen", "Beyoncé", ...: the step is exercised
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "answers,reasons",
    [
        (["Wilhelm Conrad Röntgen"], []),
        (["The Beatles", "the"], ["gold_normalizes_to_empty:'the'"]),
        (["?!", "7"], ["gold_normalizes_to_empty:'?!'", "gold_len_le_1_char"]),
        (
            ["It is", "No"],
            ["gold_reduces_to_stopword_like:'it is'", "gold_reduces_to_stopword_like:'no'"],
        ),
        (["who is who in paris"], []),  # a content word keeps it meaningful
        (["1990"], []),
    ],
)
def test_degenerate_gold_names_each_reason(answers, reasons):
    assert degenerate_gold(answers) == reasons


def test_kv_match_whole_output_case_insensitive():
    assert kv_match('x\nThe value is "ABC-1"', "abc-1")
    assert not kv_match("abc-2", "abc-1")


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4)
    assert hi == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(0, 5)[0] == 0.0
    assert wilson_interval(5, 5)[1] == 1.0


@pytest.mark.parametrize("n", [1, 2, 7, 40, 333])
def test_wilson_interval_matches_the_closed_form(n):
    z = 1.959963984540054  # the 97.5% normal quantile
    for k in range(n + 1):
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        lo, hi = wilson_interval(k, n)
        assert lo == pytest.approx(max(0.0, centre - half), abs=1e-12)
        assert hi == pytest.approx(min(1.0, centre + half), abs=1e-12)


def test_position_curve_summary():
    pairs = [(0, True), (0, True), (1, False), (1, True), (2, False), (2, False)]
    c = position_curve(pairs)
    assert [s.accuracy for s in c.positions] == [1.0, 0.5, 0.0]
    assert c.mean == pytest.approx(0.5)
    assert (c.best_position, c.worst_position, c.gap) == (0, 2, 1.0)
    with pytest.raises(RagfixError, match="no results"):
        position_curve([])


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact(1, 9) == pytest.approx(2 * 11 / 1024)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0
    # the doubled binomial tail of the smaller discordant count, capped at 1
    for b, c in [(2, 11), (11, 2), (20, 31), (5, 6), (0, 1)]:
        n = b + c
        tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
        assert mcnemar_exact(b, c) == pytest.approx(min(1.0, 2 * tail), rel=1e-12)


def test_paired_comparison_uses_only_shared_cells():
    base = {("a", 0): True, ("b", 0): False, ("a", 1): False, ("b", 1): False, ("c", 1): True}
    other = {("a", 0): True, ("b", 0): True, ("a", 1): True, ("b", 1): False, ("d", 1): True}
    c = paired_comparison(base, other)
    assert c.cells == 4 and [p.n for p in c.positions] == [2, 2]
    assert (c.only_other, c.only_baseline) == (2, 0)
    assert c.mean_diff == pytest.approx(0.5)  # +1/2 at both positions
    assert c.p_value == pytest.approx(0.5)
    with pytest.raises(RagfixError, match="share no"):
        paired_comparison(base, {("z", 0): True})
