"""The commands ``demo``, ``models`` and ``eval`` (its errors), and the Python API behind
``eval`` (:func:`ragfix.eval.run_sweep`), on bundled data: the demo with the real embedded
model, the sweeps' mechanisms with the tiny seeded models of ``conftest``."""

from __future__ import annotations

import json
import os

import pytest
from conftest import BUNDLED, run_records
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.eval import run_sweep

NQ = BUNDLED / "nq_10docs_sample.jsonl.gz"
runner = CliRunner()


def test_demo_on_one_sample_shows_the_bias_and_the_fix_on_the_same_cells(tmp_path):
    out = tmp_path / "demo"
    res = runner.invoke(app, ["demo", "--limit", "1", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    correct = {}
    for backend in ("vanilla", "attention-sort"):
        summary = json.loads((out / backend / "summary.json").read_text())
        recs = run_records(out / backend)
        assert summary["cells"] == len(recs) == 8 and summary["task"] == "kv"
        curve = summary["curves"][backend]
        assert [p["position"] for p in curve["positions"]] == list(range(8))
        assert [p["n"] for p in curve["positions"]] == [1] * 8
        assert curve["mean"] == pytest.approx(sum(r["correct"] for r in recs) / 8)
        assert summary["prefill_tokens"] > 0 and all(r["answer"] for r in recs)
        correct[backend] = {r["position"]: r["correct"] for r in recs}
    cells = [{(r["sample_id"], r["position"]) for r in run_records(out / b)} for b in correct]
    assert cells[0] == cells[1]  # the same sample at the same positions
    comparison = json.loads((out / "comparison.json").read_text())
    (pair,) = comparison["paired"]
    assert (pair["baseline"], pair["other"]) == ("vanilla:vanilla", "attention-sort:attention-sort")
    only_sort = sum(correct["attention-sort"][p] > correct["vanilla"][p] for p in range(8))
    only_vanilla = sum(correct["vanilla"][p] > correct["attention-sort"][p] for p in range(8))
    assert (pair["only_other"], pair["only_baseline"]) == (only_sort, only_vanilla)
    assert only_sort > only_vanilla  # the sort finds the gold pair where vanilla misses it
    assert (out / "curve.png").read_bytes()[:4] == b"\x89PNG"
    text = " ".join(res.output.split())
    assert "McNemar p" in text and str(out / "curve.png") in text


def test_an_unknown_dtype_is_refused_in_one_line_before_any_model_loads():
    from ragfix.errors import ConfigError
    from ragfix.models.device import resolve_dtype

    commands = [
        ["eval", "kv-sample"],
        ["eval-pipeline"],
        ["judge", "pairs.jsonl"],
        ["eval-ppl", "texts.jsonl"],
        ["serve"],
        ["calibrate"],
        ["distill", "r1", "adapter"],
        ["distill", "r2", "adapter"],
        ["tune", "attention-sort", "data.jsonl"],
    ]
    for command in commands:
        res = runner.invoke(app, [*command, "--dtype", "float33"])
        assert res.exit_code == 2, (command, res.output)
        lines = res.output.strip().splitlines()
        assert lines == ["error: dtype 'float33': expected auto, float32, bfloat16, float16"]
    res = runner.invoke(app, ["bench", "sweep", "--dtype", "float32,float33"])
    assert res.exit_code == 2 and "dtype 'float33': expected auto" in res.output
    with pytest.raises(ConfigError, match="dtype 'Tensor': expected auto"):
        resolve_dtype("Tensor")


def test_the_commands_that_load_a_backend_declare_its_options_once(monkeypatch):
    """eval, eval-pipeline, judge and serve take the backend's options from one group
    (:data:`~ragfix.cli.common.BACKEND_OPTIONS`) and build one checked reference from them: the
    same flags, validated once, and a bad option refused in the same line before any model
    loads."""
    from typer.main import get_command

    import ragfix.backends as backends
    from ragfix.cli.common import BACKEND_OPTIONS

    calls = []
    real = backends.validate_backend
    monkeypatch.setattr(
        backends, "validate_backend", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    flags = {"--" + name.replace("_", "-") for name in BACKEND_OPTIONS.options}
    assert flags >= {"--model", "--backend", "--backend-opt", "--adapter", "--dtype"}
    commands = get_command(app).commands
    for command in (
        ["eval", "kv-sample"],
        ["eval-pipeline", "--corpus", "demo", "--questions", "demo"],
        ["judge", "pairs.jsonl"],
        ["serve"],
    ):
        declared = {o for p in commands[command[0]].params for o in p.opts}
        assert flags <= declared, command
        calls.clear()
        bad = ["--backend", "attention-sort", "--backend-opt", "plac=last", "--device", "cpu"]
        res = runner.invoke(app, [*command, *bad])
        assert res.exit_code == 2, (command, res.output)
        assert res.output.strip().splitlines() == ["error: plac: Extra inputs are not permitted"]
        assert calls == [("attention-sort", None)], command


def test_models_lists_the_embedded_model_with_whole_paths():
    from ragfix.models.resolve import smollm2_gguf_path

    res = runner.invoke(app, ["models"], env={"COLUMNS": "60"})
    assert res.exit_code == 0, res.output
    rows = [line for line in res.output.splitlines() if "smollm2" in line]
    assert rows and "yes" in rows[0]  # installed
    assert f"1. {smollm2_gguf_path()}" in res.output.splitlines()  # never cut to the width
    # what --dtype auto picks here, and the CPU's bf16 kernels as torch reports them
    import torch

    kernels = (
        "amx"
        if torch.cpu._is_amx_tile_supported()
        else "avx512_bf16"
        if torch.cpu._is_avx512_bf16_supported()
        else None
    )
    line = " ".join(res.output.split()).split("dtype auto: ")[1]
    assert line.startswith("float32 (CPU)")
    assert (f"bf16 kernels ({kernels})" in line) if kernels else ("no bf16 kernels" in line)


def test_threads_option_and_variable_set_torch_threads(monkeypatch):
    import torch

    import ragfix.models.device
    from ragfix.errors import ConfigError
    from ragfix.models.device import THREADS_ENV, cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(THREADS_ENV, "1")
        assert cpu_threads() == 1 == torch.get_num_threads()
        assert cpu_threads(2) == 2 == torch.get_num_threads()  # an explicit count wins
        monkeypatch.setenv(THREADS_ENV, "two")
        with pytest.raises(ConfigError, match="RAGFIX_THREADS='two': expected a whole number"):
            cpu_threads()
        monkeypatch.delenv(THREADS_ENV)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(ragfix.models.device, "free_cpu_cores", lambda: 1)
        assert cpu_threads() == 1 == torch.get_num_threads()  # the free cores otherwise
    finally:
        torch.set_num_threads(before)
    res = runner.invoke(app, ["--threads", "0", "models", "--no-prepare"])
    assert res.exit_code == 2 and "greater than or equal to 1" in res.output


def _spin() -> None:
    while True:
        pass


def test_free_cores_are_the_usable_cores_less_those_busy_now(monkeypatch):
    import multiprocessing

    import psutil

    from ragfix.models.device import free_cpu_cores, usable_cpu_cores

    cores = usable_cpu_cores()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(cores)]
    for p in spinners:
        p.start()
    try:
        assert free_cpu_cores() == 1  # every core busy: one thread, never none
    finally:
        for p in spinners:
            p.kill()
    cpus = sorted(os.sched_getaffinity(0))
    n = max(cpus) + 1
    one_busy = [100.0 if i == cpus[0] else 0.0 for i in range(n)]
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: one_busy)
    assert free_cpu_cores() == max(1, cores - 1)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: [0.0] * n)
    assert free_cpu_cores() == cores


def test_eval_on_a_missing_file_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "nope.jsonl"
    res = runner.invoke(app, ["eval", str(missing), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"error: {missing}: file not found"]
    assert not (tmp_path / "o").exists()


def test_a_failed_first_run_does_not_block_the_corrected_rerun(tmp_path, tiny_dir):
    out = tmp_path / "run"
    args = ["eval", str(NQ), "--num-docs", "3", "--positions", "first", "--limit", "1"]
    args += ["--no-references", "--device", "cpu", "--out", str(out), "--model", tiny_dir]
    res = runner.invoke(app, [*args, "--adapter", str(tmp_path / "no-adapter")])
    assert res.exit_code == 2 and "not an adapter folder" in res.output
    assert not (out / "config.json").exists()
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    config = json.loads((out / "config.json").read_text())
    assert config["backend_options"] == {} and len(run_records(out)) == 1


def test_run_sweep_answers_are_the_same_with_and_without_prefix_reuse(tmp_path, tiny_qwen3_dir):
    # the tiny Qwen3 (peaked attention): a reused cache entry that differs from the prompt's own
    # changes its answers
    runs, seen = {}, {}
    for reuse in (True, False):
        out = tmp_path / f"reuse-{reuse}"
        seen[reuse] = []
        summary = run_sweep(
            NQ,
            out,
            model=tiny_qwen3_dir,
            num_docs=3,
            positions="all",
            limit=1,
            prefix_reuse=reuse,
            device="cpu",
            on_record=seen[reuse].append,
        )
        assert summary == json.loads((out / "summary.json").read_text())
        runs[reuse] = {r["cell_id"]: r for r in run_records(out)}
    on, off = runs[True], runs[False]
    assert len(on) == 5 and set(on) == set(off)  # same cells, same ids (2 reference points)
    assert {k: r["answer"] for k, r in on.items()} == {k: r["answer"] for k, r in off.items()}
    assert len({r["answer"] for r in on.values()}) == 5  # every cell's answer its own
    # last position first, then reuse; the reference points (position -1) after them
    assert [(r.position, r.reference) for r in seen[True]] == [
        (2, None), (1, None), (0, None), (-1, "closed-book"), (-1, "oracle")
    ]  # fmt: skip
    assert sum(r["prefill_tokens"] for r in on.values()) < sum(
        r["prefill_tokens"] for r in off.values()
    )
    # a rerun computes nothing
    again = []
    run_sweep(
        NQ,
        tmp_path / "reuse-True",
        model=tiny_qwen3_dir,
        num_docs=3,
        limit=1,
        device="cpu",
        on_record=again.append,
    )
    assert again == []


def test_eval_records_selects_by_file_index_before_limit_and_is_kept_in_config(tmp_path, tiny_dir):
    """``--records 1:3`` takes records 1 and 2 (lines 2 and 3) of the file,
    ``--limit 1`` the first of them; the range goes to config.json, and a rerun on another
    range in the same folder is refused."""
    from ragfix.connectors.litm import load_samples

    out = tmp_path / "run"
    args = ["eval", str(NQ), "--num-docs", "3", "--positions", "first", "--device", "cpu"]
    args += ["--no-references", "--model", tiny_dir]
    res = runner.invoke(app, [*args, "--records", "1:3", "--limit", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    [rec] = run_records(out)
    assert rec["sample_id"] == load_samples(NQ, 3, limit=2)[1].id
    assert json.loads((out / "config.json").read_text())["records"] == "1:3"
    res = runner.invoke(app, [*args, "--records", "3:5", "--out", str(out)])
    assert res.exit_code == 2 and 'records: "1:3" there, "3:5" now' in res.output


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--records", "5:2"], "error: --records '5:2': expected START:END"),
        (["--records", "500:600"], "no usable record in --records 500:600"),
        (["--limit", "0"], "error: --limit 0 < 1"),
        (["--batch-size", "0"], "error: --batch-size 0 < 1"),
    ],
)
def test_eval_bad_range_or_count_is_one_line(extra, message, tmp_path):
    res = runner.invoke(app, ["eval", str(NQ), *extra, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert message in " ".join(res.output.split()) and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "config.json").exists()


def test_distill_records_select_the_training_records_and_are_recorded(tmp_path):
    """``ragfix distill ... --records A:B``: the training samples come from records A..B-1 of
    each file (before --offset/--candidates); the adapter metadata records the range; a
    malformed range is one line before any model is loaded."""
    from ragfix.cli.distill_cmd import _load
    from ragfix.connectors.litm import load_samples
    from ragfix.connectors.records import parse_records
    from ragfix.distill import DistillSettings, TeacherReport, adapter_metadata
    from ragfix.distill.loop import TrainResult

    every = load_samples(NQ, 3)
    got = _load([NQ], 3, 1, 1, None, parse_records("2:5"))
    assert [s.id for s in got] == [every[3].id]  # records 2, 3, 4; skip 1, keep 1
    res = runner.invoke(
        app, ["distill", "r1", "--train", str(NQ), "--out", str(tmp_path), "--records", "x"]
    )
    assert res.exit_code == 2 and "error: --records 'x'" in res.output
    result = TrainResult(steps=1, total_steps=1, rows=3, last_loss=0.5, minutes=0.1, finished=True)
    report = TeacherReport(tried=3, kept=1, wrong=2)
    meta = adapter_metadata(DistillSettings(), {}, got, report, 3, result, train_records="2:5")
    assert meta["train_records"] == "2:5" and meta["train_question_ids"] == [every[3].id]
    assert meta["questions_tried"] == 3 and meta["teacher_answers"]["wrong"] == 2


def test_backend_help_names_every_registered_backend(monkeypatch):
    """``--backend``'s help and the backend list after ``eval --help`` come from the registry,
    read when the command is resolved: a backend registered after the CLI was imported is
    listed with its summary."""
    import ragfix.backends as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    built_in = registry.backend_names()
    registry.register_backend("test-order", "tests.nowhere:Backend", summary="a test's backend")
    names = registry.backend_names()
    assert names == sorted([*built_in, "test-order"])
    out = runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "400"}).output
    assert f"one of: {', '.join(names)} " in out
    for name in names:
        summary = registry.backend_spec(name).summary
        assert summary and f"• {name}: {summary}" in out
    assert "• test-order: a test's backend" in out
    assert "test-order" in runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "400"}).output


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--corpus", "demo", "--questions", "demo"], "--corpus"),
        ([str(NQ), "--framework=langchain"], "--framework"),
        (["kv-sample", "--num-docs", "4", "--needles", "3"], "--needles"),
        ([str(NQ), "--strategy", "none,reverse"], "--strategy"),
    ],
)
def test_eval_refuses_the_pipeline_form_naming_eval_pipeline(args, flag, tmp_path):
    """``ragfix eval`` with an option of the pipeline sweep (``--corpus``, ``--framework=X``
    ...) fails before anything runs, in one line that names ``ragfix eval-pipeline``; the
    option belongs to that command (its ``--help`` lists it)."""
    out = tmp_path / "o"
    res = runner.invoke(app, ["eval", *args, "--out", str(out)])
    assert res.exit_code == 2
    assert res.output.strip() == (
        f"error: {flag} is an option of ragfix eval-pipeline, the sweep through a real pipeline "
        "over a corpus: run ragfix eval-pipeline (ragfix eval sweeps a data file)"
    )
    assert not out.exists()
    assert flag in runner.invoke(app, ["eval-pipeline", "--help"], env={"COLUMNS": "400"}).output
