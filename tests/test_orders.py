"""Order marginalization (permutation self-consistency, arXiv 2310.07712): the designs, the
aggregators by hand, each vote against the wrapped backend's own answer on that order, and the
sweep's records, identity and refusals. The same answers through ``ragfix serve`` are checked
in tests/test_remote.py."""

from __future__ import annotations

import json
import math

import pytest
from conftest import BUNDLED

from ragfix.backends.orders import (
    OrderOptions,
    aggregate,
    candidates,
    check_orders,
    marginalize_orders,
    passage_orders,
)
from ragfix.connectors.litm import load_samples
from ragfix.errors import ConfigError, ConfigMismatchError, DataError
from ragfix.metrics import normalize_answer
from ragfix.tasks import get_task, task_prompt

KV = BUNDLED / "kv_16pairs_sample.jsonl.gz"


def test_rotate_with_k_equal_to_n_is_a_latin_square_and_fewer_are_evenly_spaced():
    orders = passage_orders(8, OrderOptions(orders=8))
    assert len(orders) == 8 and orders[0] == tuple(range(8))
    for position in range(8):  # every passage once at every position
        assert sorted(o[position] for o in orders) == list(range(8))
    four = passage_orders(8, OrderOptions(orders=4))
    assert [o[0] for o in four] == [0, 2, 4, 6]  # shifts 0, 2, 4, 6: a subset of the eight
    assert set(four) <= set(orders)
    assert len(passage_orders(3, OrderOptions(orders=8))) == 3  # distinct shifts only
    assert passage_orders(1, OrderOptions(orders=8)) == [(0,)]


def test_shuffled_orders_are_distinct_seeded_by_the_prompt_and_start_as_given():
    opts = OrderOptions(orders=5, design="shuffle", seed=3)
    a = passage_orders(6, opts, "prompt one")
    assert a == passage_orders(6, opts, "prompt one")
    assert a != passage_orders(6, opts, "prompt two")
    assert a != passage_orders(6, OrderOptions(orders=5, design="shuffle", seed=4), "prompt one")
    assert a[0] == tuple(range(6)) and len(set(a)) == 5
    assert all(sorted(o) == list(range(6)) for o in a)
    assert len(passage_orders(2, opts, "x")) == 2  # 2! orders exist
    many = passage_orders(20, OrderOptions(orders=100_000, design="shuffle"), "x")
    assert len(set(many)) == len(many) == 100_000  # distinct, drawn in linear time (a set)


def test_the_aggregators_by_hand():
    # "x" three times, unsure; "y" twice, one very sure answer; "" never chosen
    votes = [("x", -2.0), ("y", -0.1), ("X.", -1.5), ("y", -3.0), ("x", -2.5), ("", -0.01)]
    assert aggregate(votes, "plurality") == 2  # x's class (x, X., x): its most confident
    weights = {
        "x": sum(math.exp(c) for c in (-2.0, -1.5, -2.5)),
        "y": math.exp(-0.1) + math.exp(-3),
    }
    assert weights["y"] > weights["x"]
    assert aggregate(votes, "weighted") == 1
    assert aggregate(votes, "max") == 1
    # a plurality tie goes to the class with the higher mean confidence
    assert aggregate([("k", -1.0), ("m", -0.5), ("k", -2.0), ("m", -0.7)], "plurality") == 1
    assert aggregate([("", None), ("", None)], "max") == 0
    assert aggregate([("k", None), ("m", None), ("m", None)], "plurality") == 1
    assert aggregate([("a", -0.1), ("m", -1.0)], "max") == 1  # "a" normalises to nothing
    with pytest.raises(ConfigError, match="plurality"):
        aggregate([("k", None), ("m", -1.0)], "weighted")
    # score: the candidate with the largest mean log-likelihood over the orders (x: -10/3,
    # y: -1.5), whatever the single orders' confidences say
    answers = [("x", -0.1), ("y", -2.0), ("X.", -0.05)]
    assert candidates(answers) == {"x": "X.", "y": "y"}  # the most confident text of a class
    scores = [{"x": -5.0, "y": -1.0}, {"x": -1.0, "y": -2.0}, {"x": -4.0, "y": -1.5}]
    assert aggregate(answers, "score", scores) == 1
    assert aggregate(answers, "max") == 2
    with pytest.raises(ConfigError, match="score"):
        aggregate(answers, "score", [{"x": -1.0}] * 3)  # y's scores missing


def test_options_are_validated_when_built():
    for bad in ({"orders": 1}, {"orders": 4, "design": "latin"}, {"orders": 4, "vote": "max"}):
        with pytest.raises(ValueError):
            OrderOptions(**bad)


def test_each_vote_is_the_wrapped_backends_own_answer_and_confidence_on_that_order(tiny):
    sample = load_samples(KV, 4, limit=1)[0]
    prompt = task_prompt(sample, sample.passages_with_gold_at(1))
    wrapped = marginalize_orders(tiny, OrderOptions(orders=4, aggregate="max"))
    gen = wrapped.generate([prompt], batch_size=1)[0]
    assert [tuple(v["order"]) for v in gen.votes] == passage_orders(4, wrapped.options)
    singles = tiny.generate([prompt.reordered(v["order"]) for v in gen.votes], batch_size=1)
    firsts = tiny.next_token_logprobs([prompt.reordered(v["order"]) for v in gen.votes])
    # the orders are answered differently by this model: a vote not on its own order shows
    assert len({s.text for s in singles}) > 1
    for vote, single, first in zip(gen.votes, singles, firsts, strict=True):
        assert vote["answer"] == single.text
        assert vote["confidence"] == pytest.approx(float(first.max()), abs=1e-3)
    # the orders run over the prefix cache and decoded in one batch: the same votes
    reused = wrapped.generate([prompt], batch_size=4, prefix_reuse=True)[0]
    assert [v["answer"] for v in reused.votes] == [v["answer"] for v in gen.votes]
    assert reused.prefill_tokens < gen.prefill_tokens
    best = max(range(4), key=lambda i: gen.votes[i]["confidence"])
    assert gen.text == gen.votes[best]["answer"]
    assert gen.new_tokens == sum(s.new_tokens for s in singles)
    assert gen.prompt_tokens == max(s.prompt_tokens for s in singles)
    assert wrapped.identity() == {**tiny.identity(), "orders": wrapped.options.model_dump()}
    # a prompt without passage spans has one order and is answered as it is
    plain = wrapped.generate(["The capital of France is"], batch_size=1)[0]
    assert plain.votes is None and plain.text == tiny.generate(["The capital of France is"])[0].text


def test_each_candidate_is_scored_under_each_order_as_one_plain_pass_scores_it(tiny):
    """``aggregate="score"``: every vote holds each candidate answer's log-likelihood after
    that order's prompt, computed over the prefix cache; the one-pass sum of the base class
    (no cache) gives the same values, and the kept answer has the largest mean (on this model
    one of several candidates, and not the most confident vote's answer)."""
    from ragfix.backends.base import Backend

    sample = load_samples(KV, 4, limit=1)[0]
    prompt = task_prompt(sample, sample.passages_with_gold_at(1))
    wrapped = marginalize_orders(tiny, OrderOptions(orders=4, aggregate="score"))
    gen = wrapped.generate([prompt], batch_size=4, prefix_reuse=True)[0]
    names = candidates([(v["answer"], v["confidence"]) for v in gen.votes])
    assert len(names) > 1 and all(v["scores"].keys() == names.keys() for v in gen.votes)
    for v in gen.votes:
        pairs = [(prompt.reordered(v["order"]), text) for text in names.values()]
        plain = Backend.loglikelihood(tiny, pairs)
        assert list(v["scores"].values()) == pytest.approx(plain, abs=1e-3)
    mean = {n: sum(v["scores"][n] for v in gen.votes) / len(gen.votes) for n in names}
    assert normalize_answer(gen.text) == max(mean, key=mean.get)
    surest = max(gen.votes, key=lambda v: v["confidence"])["answer"]
    assert normalize_answer(gen.text) != normalize_answer(surest)  # what "max" would keep


def test_a_sweep_over_orders_keeps_every_vote_and_never_resumes_onto_other_orders(tmp_path):
    from ragfix.eval import run_sweep

    out = tmp_path / "run"
    orders = {"orders": 3, "aggregate": "plurality"}
    kw = dict(num_docs=3, limit=1, positions="0,2", device="cpu", workers=1)
    summary = run_sweep(KV, out, orders=orders, **kw)
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and summary["cells"] == 2
    for r in rows:
        assert len(r["extra"]["votes"]) == 3
        answers = [v["answer"] for v in r["extra"]["votes"]]
        assert r["answer"] in answers
    config = json.loads((out / "config.json").read_text())
    assert config["backend_options"]["orders"]["orders"] == 3
    assert config["identity"]["orders"]["aggregate"] == "plurality"
    # the tune re-aggregates the votes: the run's own setting scores as the run did
    from ragfix.eval.orders_tune import tune_orders

    table, details = tune_orders(out)
    mine = details["accuracy"]["orders=3 aggregate=plurality"]
    assert mine == [float(r["correct"]) for r in sorted(rows, key=lambda r: r["position"])]
    assert set(details["accuracy"]) == {
        f"orders={k} aggregate={a}" for k in (2, 3) for a in ("plurality", "weighted", "max")
    }
    assert details["default"]["orders"] in (2, 3) and len(table.rows) == 7
    # the ceiling: a cell is right when any of its three orders' answers is right
    task = get_task(config["task"])
    ceiling = [
        float(any(task.score(v["answer"], r["gold_answers"]) for v in r["extra"]["votes"]))
        for r in sorted(rows, key=lambda r: r["position"])
    ]
    assert details["ceiling"] == ceiling
    for acc in details["accuracy"].values():
        assert all(c >= a for c, a in zip(ceiling, acc, strict=True))
    assert table.rows[-1][0] == "ceiling: any of the 3 orders right"
    assert "(default)" not in table.rows[-1][0]
    run_sweep(KV, out, orders=orders, **kw)  # a rerun finds every cell done
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ConfigMismatchError):
        run_sweep(KV, out, orders={**orders, "orders": 2}, **kw)
    with pytest.raises(ConfigMismatchError):
        run_sweep(KV, out, **kw)  # the same folder without orders


def test_the_tune_rescores_the_scoring_aggregators_from_a_scored_sweep(tmp_path):
    """A sweep made with a scoring aggregator records every candidate's scores, so the tune
    re-scores ``score`` and ``score-max`` (and the others) from it, the run's own setting as
    the run chose."""
    from ragfix.eval import run_sweep
    from ragfix.eval.orders_tune import AGGREGATORS, tune_orders

    out = tmp_path / "scored"
    orders = {"orders": 2, "aggregate": "score-max"}
    run_sweep(KV, out, orders=orders, num_docs=3, limit=1, positions="0,2", device="cpu")
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert all("scores" in v for r in rows for v in r["extra"]["votes"])
    _, details = tune_orders(out)
    assert set(details["accuracy"]) == {f"orders=2 aggregate={a}" for a in AGGREGATORS}
    mine = details["accuracy"]["orders=2 aggregate=score-max"]
    assert mine == [float(r["correct"]) for r in sorted(rows, key=lambda r: r["position"])]


def test_the_tune_reads_a_rotate_run_without_prompts_and_refuses_a_shuffle_one(tmp_path):
    """Rotations do not depend on the prompt, so a ``rotate`` run made with
    ``--no-log-prompts`` is re-aggregated (its own setting as the run chose); ``shuffle`` orders
    are seeded by the prompt's text, so such a run is refused, naming the cell and the field."""
    from ragfix.eval import run_sweep
    from ragfix.eval.orders_tune import tune_orders

    kw = dict(num_docs=3, limit=1, positions="0,2", device="cpu", workers=1, log_prompts=False)
    rotate = tmp_path / "rotate"
    run_sweep(KV, rotate, orders={"orders": 2, "aggregate": "max"}, **kw)
    rows = [json.loads(x) for x in (rotate / "results.jsonl").read_text().splitlines()]
    assert all(r.get("prompt") is None for r in rows)
    _, details = tune_orders(rotate)
    mine = details["accuracy"]["orders=2 aggregate=max"]
    assert mine == [float(r["correct"]) for r in sorted(rows, key=lambda r: r["position"])]
    shuffle = tmp_path / "shuffle"
    run_sweep(KV, shuffle, orders={"orders": 2, "aggregate": "max", "design": "shuffle"}, **kw)
    with pytest.raises(DataError, match=r"prompt: cell \w+ has none \(the shuffle design"):
        tune_orders(shuffle)


def test_a_setting_of_orders_without_orders_is_refused_in_one_line():
    from typer.testing import CliRunner

    from ragfix.cli.app import app

    for command in (["eval", "kv-sample"], ["serve"]):
        res = CliRunner().invoke(app, [*command, "--orders-aggregate", "plurality"])
        assert res.exit_code != 0
        assert "--orders-aggregate is a setting of --orders K: give --orders too" in res.output
    res = CliRunner().invoke(app, ["eval", "kv-sample", "--orders", "3", "--orders-design", "x"])
    assert res.exit_code != 0 and "design" in res.output


def test_more_orders_than_the_passages_have_are_refused_before_any_work(tmp_path):
    """Issue 55, item 6: ``--orders K`` beyond the distinct orders of ``--num-docs`` passages
    (``rotate``: ``n``; ``shuffle``: ``n!``) ran with fewer votes than asked, silently; now the
    sweep and the pipeline refuse it in one line before a model is loaded. The count of
    ``n!`` stops past ``K``, so ``--orders 100000`` over 100 passages is answered at once."""
    from typer.testing import CliRunner

    from ragfix.backends.orders import distinct_orders

    assert [distinct_orders(n, "rotate", 50) for n in (1, 2, 8)] == [1, 2, 8]
    assert [distinct_orders(n, "shuffle", 50) for n in (1, 3, 4, 5)] == [1, 6, 24, 120]
    assert distinct_orders(100, "shuffle", 100_000) == math.factorial(9)  # stopped past K
    check_orders(OrderOptions(orders=8), 8)
    with pytest.raises(ConfigError, match=r"^--orders 9: 8 passages have only 8 distinct orders"):
        check_orders(OrderOptions(orders=9), 8)
    check_orders(OrderOptions(orders=9, design="shuffle"), 8)
    with pytest.raises(ConfigError, match="only 6 distinct orders under --orders-design shuffle"):
        check_orders(OrderOptions(orders=7, design="shuffle"), 3)
    runner = CliRunner()
    from ragfix.cli.app import app

    for command in (
        ["eval", str(KV), "--num-docs", "4"],
        ["eval-pipeline", "--corpus", "nq-sample", "--needles", "3", "--num-docs", "4"],
    ):
        res = runner.invoke(app, [*command, "--orders", "5", "--out", str(tmp_path / "r")])
        assert res.exit_code == 2, res.output
        assert "--orders 5: 4 passages have only 4 distinct orders" in res.output
        assert not (tmp_path / "r").exists()


def test_the_framework_components_refuse_the_wrapper(smol):
    """A framework's rendered prompt does not mark its passages, so RagFixLLM (and every
    consumer of plain prompts) refuses an order-marginalized backend in one line."""
    from ragfix import RagFixLLM
    from ragfix.backends.base import require_plain_prompts

    wrapped = marginalize_orders(smol, OrderOptions(orders=3))
    with pytest.raises(ConfigError, match="where the prompt says they are"):
        require_plain_prompts(wrapped, "RagFixLLM")
    with pytest.raises(ConfigError):
        RagFixLLM(wrapped)


def test_every_aggregate_answers_a_one_passage_prompt_as_the_wrapped_backend(tmp_path):
    # issue 55, item 6: one passage has one order, so one answer; score-max used to stop the
    # sweep (no candidate was scored) and serve answered 400
    from conftest import tiny_folder

    from ragfix.backends import load_backend
    from ragfix.types import Passage

    assert aggregate([("Paris", None)], "score-max") == 0  # no scores, no confidences needed
    assert aggregate([("", None), ("Rome", None)], "max") == 1  # the one answer that votes
    backend = load_backend("vanilla", model=str(tiny_folder(tmp_path / "tiny")), device="cpu")
    prompt = get_task("qa").prompt("Who wrote it?", [Passage(title="T", text="Ann wrote it.")])
    [want] = backend.generate([prompt], max_new_tokens=4, stop_at_newline=False)
    for how in ("plurality", "weighted", "max", "score", "score-max"):
        orders = marginalize_orders(backend, OrderOptions(orders=3, aggregate=how))
        [got] = orders.generate([prompt], max_new_tokens=4, stop_at_newline=False)
        assert (got.text, got.token_ids, got.votes) == (want.text, want.token_ids, None), how
