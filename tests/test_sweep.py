"""End to end: the sweep CLI on real data, resume, prefix reuse, batching (on tiny seeded
models: what is checked is the run's mechanism, not what the model reads)."""

import json
import re

import pytest
from conftest import BUNDLED, ROOT, run_records, tiny_folder
from pydantic import ValidationError
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.connectors.litm import load_samples
from ragfix.connectors.records import parse_records
from ragfix.errors import ConfigError
from ragfix.eval.sweep import (
    SweepConfig,
    open_store,
    parse_positions,
    plan_cells,
    run_cells,
)
from ragfix.eval.sweep_summary import write_report
from ragfix.metrics import mcnemar_exact

NQ = str(BUNDLED / "nq_10docs_sample.jsonl.gz")
runner = CliRunner()


def _eval(out, model, *extra):
    return runner.invoke(
        app,
        [
            "eval",
            NQ,
            "--model",
            model,
            "--num-docs",
            "3",
            "--positions",
            "first,middle,last",
            "--limit",
            "3",
            "--device",
            "cpu",
            "--out",
            str(out),
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_qwen3_dir):
    out = tmp_path_factory.mktemp("run") / "nq3"
    res = _eval(out, tiny_qwen3_dir)
    assert res.exit_code == 0, res.output
    return out, res.output


def test_cli_sweep_writes_results_summary_and_plot(finished_run, tiny_qwen3_dir, tmp_path):
    out, output = finished_run
    every = run_records(out)
    assert len(every) == 15 and len({r["cell_id"] for r in every}) == 15
    recs = [r for r in every if r["reference"] is None]  # QA: closed-book and oracle besides
    assert len(recs) == 9 and sorted({r["position"] for r in recs}) == [0, 1, 2]
    refs = sorted(r["reference"] for r in every if r["reference"])
    assert refs == ["closed-book"] * 3 + ["oracle"] * 3
    for r in recs:
        assert {"sample_id", "position", "prompt_tokens", "answer", "correct", "seconds"} <= set(r)
        assert r["prompt_tokens"] > 300 and r["prefill_tokens"] <= r["prompt_tokens"]
    summary = json.loads((out / "summary.json").read_text())
    curve = summary["curves"]["vanilla"]
    assert [p["n"] for p in curve["positions"]] == [3, 3, 3]
    assert curve["mean"] == pytest.approx(sum(r["correct"] for r in recs) / 9)
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "95% CI" in output and "gap" in output
    # the tiny model answers none right: the summary of records some of which are right (the
    # finished run's records with four cells marked right, summarised by a rerun that resumes
    # every cell) has their mean
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / "config.json").write_text((out / "config.json").read_text())
    right = {r["cell_id"] for r in recs[:4]}
    every = [{**r, "correct": r["cell_id"] in right or r["correct"]} for r in every]
    (marked / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in every))
    res = _eval(marked, tiny_qwen3_dir)
    assert res.exit_code == 0 and "resuming: 15 of 15" in res.output, res.output
    recs = [r for r in every if r["reference"] is None]
    assert 0 < sum(r["correct"] for r in recs) < 9
    curve = json.loads((marked / "summary.json").read_text())["curves"]["vanilla"]
    assert curve["mean"] == pytest.approx(sum(r["correct"] for r in recs) / 9)


def test_rerun_skips_finished_cells_and_resumes_after_a_crash(
    finished_run, tiny_qwen3_dir, tmp_path
):
    out, _ = finished_run
    before = (out / "summary.json").read_text()
    # a crash: the last two records lost, the one before torn mid-line
    lines = (out / "results.jsonl").read_text().splitlines()
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "config.json").write_text((out / "config.json").read_text())
    (crashed / "results.jsonl").write_text("\n".join(lines[:6]) + "\n" + lines[6][:40])
    res = _eval(crashed, tiny_qwen3_dir)
    assert res.exit_code == 0, res.output
    assert "resuming: 6 of 15 cells already done" in res.output
    recs = open_store(crashed).load()
    assert len(recs) == 15
    summary = json.loads((crashed / "summary.json").read_text())
    assert summary["curves"] == json.loads(before)["curves"]
    # every cell has the answer of the uninterrupted run (the tiny model's differ from cell to
    # cell, so a recomputed cell that read another cell's prompt would show)
    answers = {r["cell_id"]: r["answer"] for r in run_records(out)}
    assert {k: r["answer"] for k, r in recs.items()} == answers
    assert len(set(answers.values())) == 15
    # a rerun of a finished run computes nothing and loads no model
    res = _eval(out, tiny_qwen3_dir)
    assert "resuming: 15 of 15" in res.output and len(run_records(out)) == 15


def test_report_compares_runs_cell_by_cell(finished_run, tmp_path):
    out, _ = finished_run
    other = tmp_path / "other"
    other.mkdir()
    recs = run_records(out)
    curve = [r for r in recs if r["reference"] is None]
    flipped = {curve[0]["cell_id"], curve[4]["cell_id"]}
    for r in recs:  # a second system that differs from the first on two cells
        r["correct"] = not r["correct"] if r["cell_id"] in flipped else r["correct"]
        r["backend"] = "other"
    (other / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    config = json.loads((out / "config.json").read_text())  # same cells, another backend
    (other / "config.json").write_text(json.dumps({**config, "backend": "other"}))
    write_report(other, recs)
    png = tmp_path / "cmp.png"
    res = runner.invoke(app, ["report", str(out), str(other), "--out", str(png)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    gained = sum(r["correct"] for r in recs if r["cell_id"] in flipped)
    assert "9 cells" in text and f"right only in other:other {gained}" in text
    p = mcnemar_exact(gained, 2 - gained)
    assert f"only in nq3:vanilla {2 - gained}" in text and f"McNemar p = {p:.3g}" in text
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_interrupted_sweep_keeps_every_finished_cell(tiny, tiny_dir, tmp_path):
    samples = load_samples(NQ, 3, limit=2)
    cfg = SweepConfig(data=NQ, task="qa", num_docs=3, model=tiny_dir, backend="vanilla")
    cells = plan_cells(cfg, samples, [0, 2])
    store = open_store(tmp_path)

    def stop_after_three(rec):
        store.append(rec.model_dump())
        if len(store.load()) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_cells(tiny, cells, stop_after_three)
    done = store.load()
    assert len(done) == 3
    todo = [c for c in cells if c.cell_id not in done]
    run_cells(tiny, todo, lambda r: store.append(r.model_dump()))
    assert set(store.load()) == {c.cell_id for c in cells}


@pytest.mark.parametrize("prefix_reuse", [True, False])
def test_each_sample_is_checked_just_before_it_runs(tiny, tiny_dir, monkeypatch, prefix_reuse):
    """The fit check of the second sample comes after the first sample's answers, so a backend
    whose check costs a model pass shows progress from the first sample on."""
    samples = load_samples(NQ, 3, limit=2)
    cfg = SweepConfig(data=NQ, task="qa", num_docs=3, model=tiny_dir, backend="vanilla")
    cells = plan_cells(cfg, samples, [0, 2])
    events = []
    fit, generate = tiny.fit, tiny.generate
    monkeypatch.setattr(tiny, "fit", lambda p: events.append("fit") or fit(p))
    monkeypatch.setattr(
        tiny, "generate", lambda ps, **kw: events.append("gen") or generate(ps, **kw)
    )
    done = []
    run_cells(
        tiny,
        cells,
        lambda r: done.append((r.sample_id, events.count("fit"))),
        batch_size=2,
        prefix_reuse=prefix_reuse,
    )
    assert events == ["fit", "fit", "gen", "fit", "fit", "gen"]
    assert done == [(samples[0].id, 2)] * 2 + [(samples[1].id, 4)] * 2


def test_prefix_reuse_gives_the_same_answers_as_naive(tiny_qwen3_dir):
    """On a tiny model whose answer differs at each of the four positions, so that a cell
    answered over another cell's cache would show."""
    from ragfix.backends import load_backend

    backend = load_backend("vanilla", model=tiny_qwen3_dir, device="cpu")
    samples = load_samples(NQ, 4, limit=1)
    cfg = SweepConfig(data=NQ, task="qa", num_docs=4, model=tiny_qwen3_dir, backend="vanilla")
    cells = plan_cells(cfg, samples, [0, 1, 2, 3])
    naive, reused = {}, {}
    run_cells(backend, cells, lambda r: naive.setdefault(r.cell_id, r), prefix_reuse=False)
    run_cells(backend, cells, lambda r: reused.setdefault(r.cell_id, r), prefix_reuse=True)
    assert {k: r.answer for k, r in naive.items()} == {k: r.answer for k, r in reused.items()}
    assert len({r.answer for r in naive.values()}) == 4
    assert sum(r.prefill_tokens for r in reused.values()) < 0.8 * sum(
        r.prefill_tokens for r in naive.values()
    )


@pytest.mark.parametrize(
    "name, options",
    [
        ("vanilla", {}),
        ("rope-scaled", {"rope_type": "linear", "factor": 4.0, "train_window": 256}),
        ("channel-scaled", {"channel": 46, "layers": "0-1", "factor": 4.0}),
        ("gali", {"train_window": 256}),
    ],
)
def test_batched_sweep_gives_the_naive_answers_for_every_backend(name, options, tiny_qwen3_dir):
    # issue 17: a sample's cells batched (over their shared prefix where the backend allows it,
    # else by length) give the answers of one cell at a time without any cache reuse; on a
    # tiny model whose answers differ from cell to cell and, each method's but vanilla's, from
    # vanilla's (so the method's own path is the one compared)
    from ragfix.backends import load_backend

    backend = load_backend(name, model=tiny_qwen3_dir, device="cpu", **options)
    samples = load_samples(NQ, 4, limit=1)
    cfg = SweepConfig(data=NQ, task="qa", num_docs=4, model=tiny_qwen3_dir, backend=name)
    cells = plan_cells(cfg, samples, [0, 2, 3])
    naive, batched = {}, {}
    run_cells(backend, cells, lambda r: naive.setdefault(r.cell_id, r), prefix_reuse=False)
    run_cells(backend, cells, lambda r: batched.setdefault(r.cell_id, r), batch_size=3)
    assert {k: r.answer for k, r in batched.items()} == {k: r.answer for k, r in naive.items()}
    assert len(naive) == 3 and all(r.prompt_tokens > 256 and not r.flags for r in naive.values())
    shared = sum(r.prefill_tokens for r in batched.values()) < sum(
        r.prefill_tokens for r in naive.values()
    )
    assert shared == backend.supports_prefix_reuse
    assert len({r.answer for r in naive.values()}) == 3
    vanilla = load_backend("vanilla", model=tiny_qwen3_dir, device="cpu")
    plain = {}
    run_cells(vanilla, cells, lambda r: plain.setdefault(r.cell_id, r.answer), prefix_reuse=False)
    assert ({k: r.answer for k, r in naive.items()} == plain) == (name == "vanilla")
    if name == "channel-scaled":  # the shipped calibration applies to the real SmolLM2
        calibration = str(ROOT / "calib" / "smollm2.json")
        real = load_backend(name, device="cpu", calibration=calibration)
        assert real.source == f"calibration:{calibration}"


def test_output_folder_of_another_config_is_refused(finished_run, tiny_qwen3_dir):
    out, _ = finished_run
    res = _eval(out, tiny_qwen3_dir, "--backend-opt", "foo=1")
    assert res.exit_code == 2
    more = ["--model", tiny_qwen3_dir, "--out", str(out), "--device", "cpu"]
    res = runner.invoke(app, ["eval", NQ, "--num-docs", "4", "--limit", "1", *more])
    assert res.exit_code == 2
    assert "holds a run of other settings, weights or inputs" in res.output
    assert "num_docs: 3 there, 4 now" in res.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["/no/such.jsonl"], "file not found"),
        ([NQ, "--positions", "0,12"], "12 is out of range 0..9"),
        ([NQ, "--positions", "start"], "'start' is not 'all'"),
        ([NQ, "--num-docs", "80"], "needs 79 distractors"),
        ([NQ, "--model", "./missing-model"], "model path not found"),
        ([NQ, "--backend", "nope"], "unknown backend 'nope'"),
        ([NQ, "--workers", "0"], "--workers 0: give at least 1"),
        ([NQ, "--workers", "2", "--device", "cuda"], "worker processes are for a local model"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    res = runner.invoke(app, ["eval", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert message in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--corpus", "c", "--needles", "0"], "greater than or equal to 1"),
        (["--corpus", "c", "--needles", "2", "--limit", "1"], "--needles N sets their number"),
        (["--corpus", "c", "--needles", "2", "--questions", "q"], "--questions and --needles"),
        (["--corpus", "c"], "needs one source of questions"),
    ],
)
def test_bad_pipeline_input_is_one_clear_line(args, message, tmp_path):
    res = runner.invoke(app, ["eval-pipeline", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert message in res.output
    assert "Traceback" not in res.output


def test_malformed_record_stops_or_is_skipped(tmp_path):
    src = BUNDLED / "nq_10docs_sample.jsonl.gz"
    import gzip

    with gzip.open(src, "rt") as f:
        lines = f.read().splitlines()[:3]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n{broken\n" + lines[1] + "\n")
    res = runner.invoke(app, ["eval", str(bad), "--out", str(tmp_path / "o"), "--num-docs", "2"])
    assert res.exit_code == 2 and "bad.jsonl:2: malformed JSON" in res.output
    assert parse_positions("first,middle,last", 10) == [0, 4, 9]


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("0:200", slice(0, 200)),
        ("200:", slice(200, None)),
        (":5", slice(0, 5)),
        (" 3:4 ", slice(3, 4)),
    ],
)
def test_parse_records(spec, expected):
    assert parse_records(spec) == expected


@pytest.mark.parametrize("spec", ["5:2", "3:3", "-1:4", "a:b", "200", "1:2:3"])
def test_a_malformed_record_range_is_one_line_naming_it(spec):
    with pytest.raises(ConfigError, match=r"--records .*expected START:END") as e:
        parse_records(spec)
    assert repr(spec) in str(e.value) and "\n" not in str(e.value)


def test_sweep_config_is_validated_when_built():
    base = dict(data=NQ, task="qa", num_docs=3, model="smollm2", backend="vanilla")
    assert SweepConfig(**base, records="0:10").records == "0:10"
    assert SweepConfig(**base, records=" :10").records == "0:10"  # one spelling per range
    with pytest.raises(ValidationError, match="extra"):
        SweepConfig(**base, num_doc=3)  # a typo is refused, not ignored
    with pytest.raises(ValidationError, match="num_docs 0 < 1"):
        SweepConfig(**{**base, "num_docs": 0})
    with pytest.raises(ValidationError, match="--records '9:1'"):
        SweepConfig(**base, records="9:1")


def test_positions_out_of_range_name_both_values():
    with pytest.raises(ConfigError, match="12 is out of range 0..9 for --num-docs 10"):
        parse_positions("0,12", 10)


def test_bench_sweep_compares_the_three_modes_token_by_token(tmp_path):
    # issue 17: ``ragfix bench sweep`` runs the same cells naive, with prefix reuse and with the
    # trie prefill plus batched decode, and compares their generated tokens with naive's
    from ragfix.bench.sweep import bench_sweep

    tiny_folder(tmp_path)
    table, details = bench_sweep(
        "nq-sample", num_docs=3, limit=2, model=str(tmp_path), device="cpu"
    )
    assert [r[:2] for r in table.rows] == [
        ["naive", "float32"],
        ["prefix reuse", "float32"],
        ["prefix + batched", "float32"],
    ]
    assert table.headers[-3:] == ["labels as naive", "answers as naive", "tokens as naive"]
    modes = details["modes"]
    assert all(m["identical_tokens"] == 6 and not m["token_differences"] for m in modes.values())
    assert modes["prefix + batched"]["decoded_tokens"] == modes["naive"]["decoded_tokens"] > 0
    # the trie prefill computes what one cell at a time over the kept cache computes
    assert modes["prefix + batched"]["prefill_tokens"] == modes["prefix reuse"]["prefill_tokens"]
    assert modes["prefix reuse"]["prefill_tokens"] < modes["naive"]["prefill_tokens"]
    assert table.lines[-1].startswith("wall time: ") and "x less than naive" in table.lines[-1]


def test_bench_sweep_runs_every_mode_in_each_dtype_against_the_first(tmp_path):
    """``--dtype float32,bfloat16``: the three modes in each dtype on the same cells, every row
    compared with float32's naive; the tokens bf16 decodes are its own (its naive equals what
    ``generate`` of a bf16 model gives), and the wall-time lines pair each mode across dtypes."""
    from ragfix.backends import load_backend
    from ragfix.bench.sweep import bench_sweep
    from ragfix.errors import ConfigError

    tiny_folder(tmp_path)
    table, details = bench_sweep(
        "nq-sample", 3, 1, str(tmp_path), "cpu", dtypes=("float32", "bfloat16")
    )
    assert details["dtypes"] == ["float32", "bfloat16"]
    assert [r[:2] for r in table.rows] == [
        [mode, dtype]
        for dtype in ("float32", "bfloat16")
        for mode in ("naive", "prefix reuse", "prefix + batched")
    ]
    modes = details["modes"]
    assert modes["naive · float32"]["identical_tokens"] == 3
    bf16 = modes["naive · bfloat16"]
    assert bf16["identical_tokens"] == 3 - len(bf16["token_differences"])
    # the bf16 rows decode with the bf16 model: its naive answers are bf16 generate's
    from ragfix.connectors.litm import load_samples
    from ragfix.tasks import task_prompt

    sample = load_samples(BUNDLED / "nq_10docs_sample.jsonl.gz", 3, 1)[0]
    prompts = [task_prompt(sample, sample.passages_with_gold_at(p)) for p in range(3)]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        b = load_backend("vanilla", model=str(tmp_path), device="cpu", dtype=dtype)
        runs[dtype] = [b.generate([p])[0].token_ids for p in prompts]
    diffs = {d["position"]: d["tokens"] for d in bf16["token_differences"]}
    for p in range(3):  # bf16's own tokens wherever they differ from float32's
        if runs["bfloat16"][p] == runs["float32"][p]:
            assert p not in diffs
        else:
            assert diffs[p] == runs["bfloat16"][p]
    assert modes["naive · bfloat16"]["tokens_as_own_naive"] == 3
    for mode in ("prefix reuse", "prefix + batched"):  # batch invariance within bf16
        n = modes[f"{mode} · bfloat16"]["tokens_as_own_naive"]
        assert f"bfloat16: {mode} gives bfloat16 naive's tokens in {n}/3 cells" in table.lines
    assert table.lines[-4] == "labels, answers and tokens compared with naive · float32"
    names = ("naive", "prefix reuse", "prefix + batched")
    for line, mode in zip(table.lines[-3:], names, strict=True):
        assert re.fullmatch(
            rf"{re.escape(mode)}: bfloat16 \d+\.\d\dx less wall time than float32", line
        )
    with pytest.raises(ConfigError, match="a dtype is named twice"):
        bench_sweep("nq-sample", 3, 1, str(tmp_path), "cpu", dtypes=("auto", "float32"))
