"""Run folders are bound to what they ran on: for every run kind (sweep, pipeline sweep, judge,
perplexity), a rerun after the weights, an adapter, a calibration or an input file changed in
place is refused (or starts over with ``restart``), never resumed; reports read the cells the
run reported. Tiny seeded models with SmolLM2's tokenizer, saved as real checkpoint folders."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import BUNDLED, run_records, tiny_folder

from ragfix.errors import ConfigError, ConfigMismatchError, DataError
from ragfix.eval import run_judge, run_sweep
from ragfix.eval.compare import compare_runs, load_run, uneven_positions
from ragfix.eval.pipeline import run_pipeline_sweep
from ragfix.eval.ppl import run_ppl
from ragfix.eval.run import RunConfig, RunFolder, RunKind, run

NQ = BUNDLED / "nq_10docs_sample.jsonl.gz"


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _sweep(out, model, data=NQ, limit=2, **kw):
    """A sweep of the tiny model without the QA reference points (what these tests count)."""
    kw.setdefault("references", False)
    seen = []
    summary = run_sweep(
        data,
        out,
        model=str(model),
        num_docs=2,
        limit=limit,
        workers=1,
        device="cpu",
        on_record=seen.append,
        **kw,
    )
    return summary, seen


@pytest.fixture
def model_dir(tmp_path):
    """The tiny model in a folder of the test's own, for the tests that save into it or edit its
    files (the others read the session's ``tiny_dir``: the same seed)."""
    return tiny_folder(tmp_path / "model", seed=0)


def _nq_copy(path, n=3):
    """The first ``n`` records of the bundled NQ sample as a file of one's own."""
    with gzip.open(NQ, "rt") as f:
        lines = [next(f) for _ in range(n)]
    path.write_text("".join(lines))
    return path


def _set_json(path: Path, **changes) -> str:
    """Set ``changes`` in the JSON file ``path``; returns its text before."""
    before = path.read_text()
    path.write_text(json.dumps({**json.loads(before), **changes}, indent=2))
    return before


# ------------------------------------------------------------------ sweep
def test_sweep_refuses_weights_saved_into_its_model_folder_and_restarts_when_asked(
    tmp_path, model_dir
):
    out = tmp_path / "run"
    _, first = _sweep(out, model_dir)
    assert len(first) == 4
    _, again = _sweep(out, model_dir)  # the same weights: every cell reused
    assert again == []
    tiny_folder(model_dir, seed=1)  # new weights into the same folder
    # the folder is finished: it is checked all the same
    with pytest.raises(ConfigMismatchError, match=r"identity\.model\.weights: .* there, .* now"):
        _sweep(out, model_dir)
    assert len(_lines(out / "results.jsonl")) == 4  # nothing lost
    summary, fresh = _sweep(out, model_dir, restart=True)
    assert len(fresh) == 4 and summary["cells"] == 4
    assert len(_lines(out / "results.jsonl")) == 4  # the old cells are gone, not mixed in
    stored = json.loads((out / "config.json").read_text())
    assert stored["identity"]["model"]["weights"].startswith("files:")


def test_sweep_refuses_an_adapter_retrained_into_the_same_folder(tmp_path, tiny_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = tmp_path / "lora"

    def train(seed):
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_pretrained(tiny_dir)
        cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
        get_peft_model(m, cfg).save_pretrained(lora)

    train(0)
    out = tmp_path / "run"
    _, first = _sweep(out, tiny_dir, limit=1, adapter=lora)
    assert len(first) == 2
    train(1)
    with pytest.raises(ConfigMismatchError, match=r"identity\.adapter\.fingerprint"):
        _sweep(out, tiny_dir, limit=1, adapter=lora)


def test_sweep_refuses_a_calibration_file_edited_in_place(tmp_path, tiny_dir):
    from ragfix.backends.channel_scaling import ChannelScalingCalibration
    from ragfix.models.load import load_model, model_identity

    cal = tmp_path / "cal.json"

    def calibrate(channel):
        ChannelScalingCalibration(
            model=model_identity(load_model(str(tiny_dir), device="cpu")[0]),
            channel=channel,
            layers=[1],
            factor=0.5,
            baseline_loss=1.0,
            factor_losses={"0.5": 0.9},
            candidates=[],
            settings={},
            minutes=0.1,
        ).save(cal)

    calibrate(3)
    out = tmp_path / "run"
    opts = {"calibration": str(cal)}
    _sweep(out, tiny_dir, limit=1, backend="channel-scaled", backend_options=opts)
    calibrate(4)  # another channel in the same file
    with pytest.raises(ConfigMismatchError, match=r"identity\.scaling\.calibration"):
        _sweep(out, tiny_dir, limit=1, backend="channel-scaled", backend_options=opts)


def test_sweep_refuses_a_data_file_or_pool_edited_in_place(tmp_path, tiny_dir):
    data = _nq_copy(tmp_path / "nq.jsonl")
    out = tmp_path / "run"
    _sweep(out, tiny_dir, data=data, limit=1)
    data.write_text(data.read_text().replace("the", "teh", 1))  # one passage edited
    with pytest.raises(ConfigMismatchError, match=r"inputs\.data: "):
        _sweep(out, tiny_dir, data=data, limit=1)
    _, fresh = _sweep(out, tiny_dir, data=data, limit=1, restart=True)
    assert len(fresh) == 2
    load_run(out)  # the report reads the run's cells only

    pool = _nq_copy(tmp_path / "pool.jsonl", 3)
    pooled = tmp_path / "pooled"
    _sweep(pooled, tiny_dir, data=data, limit=1, distractor_pool=pool)
    with open(pool, "a") as f:  # a record more in the pool: other BM25 distractors may win
        f.write(_nq_copy(tmp_path / "more.jsonl", 4).read_text().splitlines(keepends=True)[3])
    with pytest.raises(ConfigMismatchError, match=r"inputs\.distractor_pool: "):
        _sweep(pooled, tiny_dir, data=data, limit=1, distractor_pool=pool)


def test_inputs_read_from_another_place_with_the_same_content_resume(tmp_path, tiny_dir):
    """A copied checkout or a moved file: a run kind whose input paths stay out of its cell ids
    (sweep, judge) compares the content's fingerprint, not the path, and then records where the
    input lies now; other content is still refused. One whose ids hash the path refuses."""
    here, there = tmp_path / "here", tmp_path / "there"
    for folder in (here, there):
        folder.mkdir()
    data, pool = _nq_copy(here / "nq.jsonl"), _nq_copy(here / "pool.jsonl", 3)
    out = tmp_path / "run"
    _, first = _sweep(out, tiny_dir, data=data, limit=1, distractor_pool=pool)
    for f in (data, pool):
        f.rename(there / f.name)
    data, pool = there / data.name, there / pool.name
    _, more = _sweep(out, tiny_dir, data=data, limit=2, distractor_pool=pool)
    assert len(first) == len(more) == 2  # the second sample's cells only: the first's reused
    config = json.loads((out / "config.json").read_text())
    assert (config["data"], config["distractor_pool"]) == (str(data), str(pool))
    data.write_text(data.read_text().replace("the", "teh", 1))
    with pytest.raises(ConfigMismatchError, match=r"inputs\.data: "):
        _sweep(out, tiny_dir, data=data, limit=2, distractor_pool=pool)

    pairs = here / "pairs.jsonl"
    pairs.write_text(json.dumps({"question": "2 + 2?", "answer_a": "4", "answer_b": "5"}) + "\n")
    judged = tmp_path / "judge"
    assert run_judge(pairs, judged, model=str(tiny_dir), device="cpu").computed == 1
    pairs = pairs.rename(there / pairs.name)
    again = run_judge(pairs, judged, model=str(tiny_dir), device="cpu")
    assert (again.computed, again.reused) == (0, 1)
    assert json.loads((judged / "config.json").read_text())["data"] == str(pairs)

    texts = here / "texts.jsonl"  # perplexity's cell ids hash the path: bound to it
    texts.write_text(json.dumps({"text": " ".join(f"word{i} and more" for i in range(80))}))
    kw = dict(train_window=16, ratios=(1.0,), methods=("vanilla",), windows=range(1))
    run_ppl(texts, model=str(tiny_dir), device="cpu", out=tmp_path / "ppl", **kw)
    texts = texts.rename(there / texts.name)
    with pytest.raises(ConfigMismatchError, match=r"data: "):
        run_ppl(texts, model=str(tiny_dir), device="cpu", out=tmp_path / "ppl", **kw)


def test_a_folder_from_before_identity_binding_is_refused_in_one_line(tmp_path, tiny_dir):
    out = tmp_path / "run"
    _sweep(out, tiny_dir, limit=1)
    config = json.loads((out / "config.json").read_text())
    old = {k: v for k, v in config.items() if k not in ("run", "format", "identity", "inputs")}
    (out / "config.json").write_text(json.dumps(old))
    with pytest.raises(ConfigMismatchError, match="written by an earlier ragfix") as e:
        _sweep(out, tiny_dir, limit=1)
    assert "\n" not in str(e.value)
    _, fresh = _sweep(out, tiny_dir, limit=1, restart=True)
    assert len(fresh) == 2


def test_the_cli_refuses_in_one_line_and_restarts_with_the_flag(tmp_path, model_dir):
    from typer.testing import CliRunner

    from ragfix.cli.app import app

    out = tmp_path / "run"
    args = ["eval", str(NQ), "--model", str(model_dir), "--num-docs", "2", "--limit", "1",
            "--no-references", "--workers", "1", "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert CliRunner().invoke(app, args).exit_code == 0
    tiny_folder(model_dir, seed=4)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    [line] = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert "identity.model.weights" in line and "--restart" in line
    res = CliRunner().invoke(app, [*args, "--restart"])
    assert res.exit_code == 0, res.output
    assert len(_lines(out / "results.jsonl")) == 2


def test_report_counts_exactly_the_cells_its_run_reports(tmp_path, tiny_dir):
    out = tmp_path / "run"
    _sweep(out, tiny_dir, limit=2)
    summary, seen = _sweep(out, tiny_dir, limit=1)  # a smaller rerun of the same folder
    assert seen == [] and summary["cells"] == 2
    assert len(_lines(out / "results.jsonl")) == 4  # the folder keeps the other sample's cells
    run = load_run(out)
    assert sorted(run.curves["vanilla"]) == sorted(
        (r["sample_id"], r["position"]) for r in _lines(out / "results.jsonl")[:2]
    )
    merit = compare_runs([out])["runs"][0]["curves"]["vanilla"]
    assert [p["n"] for p in merit["positions"]] == [1, 1]

    # an extension to more positions, interrupted: the report stays on the finished run
    ext = tmp_path / "ext"
    _sweep(ext, tiny_dir, limit=2, positions="0")

    def interrupt(rec):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(
            NQ,
            ext,
            model=str(tiny_dir),
            num_docs=2,
            limit=2,
            workers=1,
            device="cpu",
            on_record=interrupt,
            references=False,
        )
    assert len(_lines(ext / "results.jsonl")) == 3
    comparison = compare_runs([ext])
    assert [p["n"] for p in comparison["runs"][0]["curves"]["vanilla"]["positions"]] == [2]
    assert comparison["notes"] == []


def test_uneven_positions_are_named():
    cells = {("a", 0): True, ("b", 0): False, ("a", 1): True}
    assert uneven_positions(cells) == (
        "its positions cover different samples (samples per position 0: 2, 1: 1)"
    )
    assert uneven_positions({("a", 0): True, ("a", 1): False}) is None


@pytest.mark.processes
def test_a_killed_worker_is_one_line_and_exit_2(tmp_path, tiny_dir):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ragfix.cli", "eval", str(NQ), "--model", str(tiny_dir),
           "--num-docs", "2", "--limit", "4", "--workers", "2", "--device", "cpu",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.time()
    shards = []
    while not shards and p.poll() is None and time.time() - start < 240:
        time.sleep(0.2)
        shards = [f for f in out.glob("results.rank*.jsonl") if f.read_text().strip()]
    assert shards, p.communicate()
    children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    workers = [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    assert workers
    os.kill(int(workers[0]), signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    lines = [x for x in err.splitlines() if x.strip() and "Loading weights" not in x]
    assert len(lines) == 1 and "died (exit code -9)" in lines[0], err
    assert "Traceback" not in err


def _gone(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.processes
def test_workers_end_with_a_killed_parent_and_the_run_resumes(tmp_path, tiny_dir):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ragfix.cli", "eval", str(NQ), "--model", str(tiny_dir),
           "--num-docs", "2", "--limit", "20", "--no-references", "--workers", "2",
           "--device", "cpu", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.time()
    shards = []
    while not shards and p.poll() is None and time.time() - start < 240:
        time.sleep(0.2)
        shards = [f for f in out.glob("results.rank*.jsonl") if f.read_text().strip()]
    assert shards and p.poll() is None
    children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    workers = [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(workers) == 2
    os.kill(p.pid, signal.SIGKILL)  # no handler runs: the workers must notice by themselves
    p.wait()
    deadline = time.time() + 30
    while not all(_gone(w) for w in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert all(_gone(w) for w in workers)
    sizes = [f.stat().st_size for f in out.glob("results.rank*.jsonl")]
    time.sleep(1.0)
    assert [f.stat().st_size for f in out.glob("results.rank*.jsonl")] == sizes
    done = {
        (r["sample_id"], r["position"]) for f in out.glob("results.rank*.jsonl") for r in _lines(f)
    }
    assert 0 < len(done) < 40  # 20 of the bundled sample's questions, the gold at 2 positions
    summary, seen = _sweep(out, tiny_dir, limit=20)  # resumes: only the missing cells
    assert summary["cells"] == 40 and len(seen) == 40 - len(done)
    assert not done & {(r.sample_id, r.position) for r in seen}


def _child_outlives_a_killed_parent(script: str) -> bool:
    """Run ``script`` (it starts a child and prints the child's pid) as a process, kill that
    process with SIGKILL (no handler of it runs) and say whether the child is still there 20 s
    later (then it is killed here)."""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = parent.stdout.readline().strip()
    assert not _gone(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 20
    while not _gone(child) and time.time() < deadline:
        time.sleep(0.1)
    if _gone(child):
        return False
    os.kill(int(child), signal.SIGKILL)
    return True


@pytest.mark.processes
def test_the_thread_benchmark_spinners_end_with_a_killed_bench():
    script = (
        "import multiprocessing as mp, time\n"
        "from ragfix.bench.threads import _spin\n"
        "p = mp.get_context('fork').Process(target=_spin, daemon=True)\n"
        "p.start()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    assert not _child_outlives_a_killed_parent(script)


@pytest.mark.processes
def test_a_subprocess_started_with_the_parent_death_signal_ends_with_its_parent():
    script = (
        "import subprocess, sys, time\n"
        "from ragfix.models.device import parent_death_signal\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                         preexec_fn=parent_death_signal())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    assert not _child_outlives_a_killed_parent(script)


# ------------------------------------------------------------------ pipeline sweep
@pytest.fixture
def small_corpus(tmp_path):
    from ragfix.connectors.corpus import DEMO_CORPUS, DEMO_QUESTIONS

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(DEMO_CORPUS.read_text().splitlines(keepends=True)[:6]))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(DEMO_QUESTIONS.read_text().splitlines(keepends=True)[0])
    return corpus, questions


def test_pipeline_sweep_refuses_edited_corpus_questions_and_weights(
    tmp_path, model_dir, small_corpus
):
    corpus, questions = small_corpus
    out = tmp_path / "run"

    def sweep(**kw):
        return run_pipeline_sweep(
            corpus=corpus,
            questions=questions,
            out=out,
            strategies=["none"],
            top_k=2,
            model=str(model_dir),
            device="cpu",
            **kw,
        )

    first = sweep()
    assert first["cells"] == 2
    assert sweep()["cell_ids"] == first["cell_ids"]
    rows = questions.read_text()
    questions.write_text(rows.replace('"question": "', '"question": "Q: ', 1))
    with pytest.raises(ConfigMismatchError, match=r"inputs\.questions: "):
        sweep()
    questions.write_text(rows)
    text = corpus.read_text()
    corpus.write_text(text + text.splitlines(keepends=True)[0].replace('"id": "', '"id": "x', 1))
    with pytest.raises(ConfigMismatchError, match=r"inputs\.corpus: "):
        sweep()
    corpus.write_text(text)
    cfg = model_dir / "tokenizer_config.json"
    before = _set_json(cfg, eos_token="<|endoftext|>")
    with pytest.raises(ConfigMismatchError, match=r"identity\.tokenizer: "):
        sweep()
    cfg.write_text(before)
    tiny_folder(model_dir, seed=5)
    with pytest.raises(ConfigMismatchError, match=r"identity\.model\.weights"):
        sweep()
    assert sweep(restart=True)["cells"] == 2


def test_a_rerun_after_the_tokenizer_chat_template_or_generation_config_changed_is_refused(
    tmp_path, model_dir
):
    """Issue 45 (vllm#4180's fix, ``eos_token`` edited in ``tokenizer_config.json``): the
    identity covers the tokenizer, the chat template and the generation config, so a rerun is
    refused instead of mixing cells that stop at the old EOS token with new ones; restoring the
    file resumes again, with nothing recomputed."""
    out = tmp_path / "run"
    _, first = _sweep(out, model_dir, limit=1)
    assert len(first) == 2
    assert _sweep(out, model_dir, limit=1)[1] == []  # unchanged: every cell reused
    cfg = model_dir / "tokenizer_config.json"
    before = _set_json(cfg, eos_token="<|endoftext|>")
    with pytest.raises(ConfigMismatchError, match=r"identity\.tokenizer: "):
        _sweep(out, model_dir, limit=1)
    cfg.write_text(before)
    assert _sweep(out, model_dir, limit=1)[1] == []
    template = model_dir / "chat_template.jinja"
    original = template.read_text()
    template.write_text(original.replace("<|im_start|>", "<|im_start|> "))
    with pytest.raises(ConfigMismatchError, match=r"identity\.chat_template: "):
        _sweep(out, model_dir, limit=1)
    template.write_text(original)
    gen = model_dir / "generation_config.json"
    before = _set_json(gen, repetition_penalty=1.3)
    with pytest.raises(ConfigMismatchError, match=r"identity\.generation_config: "):
        _sweep(out, model_dir, limit=1)
    gen.write_text(before)
    assert _sweep(out, model_dir, limit=1)[1] == []
    assert len(_lines(out / "results.jsonl")) == 2  # nothing lost, nothing mixed in


def test_a_base_models_record_keeps_the_completion_prefix_it_read(tmp_path, model_dir):
    """A model without a chat template reads a KV prompt's completion form (``... Corresponding
    value: "``): the record stores that prefix, not the chat form's assistant prefix, so the
    stored text and prefix are exactly what the model read; ``ragfix report --html`` rebuilds
    the same for a run without stored prompts (:func:`reads_chat` of its identity)."""
    from ragfix.eval.html_report import reads_chat
    from ragfix.prompts import NO_CHAT_TEMPLATE

    (model_dir / "chat_template.jinja").unlink()
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="no chat template"):
        _sweep(out, model_dir, data=BUNDLED / "kv_16pairs_sample.jsonl.gz", limit=1)
    [rec, *_] = _lines(out / "results.jsonl")
    prompt = rec["prompt"]
    assert prompt["assistant_prefix"] == ' "'
    assert prompt["text"].endswith("Corresponding value:")
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["chat_template"] == NO_CHAT_TEMPLATE and not reads_chat(config)
    assert reads_chat({"identity": {"chat_template": "0123456789ab"}})
    # a folder written when the completion form had no BOS: its own record, read the same way
    assert not reads_chat({"identity": {"chat_template": "none: the task's completion form"}})


# ------------------------------------------------------------------ judge
def test_judge_refuses_a_finished_folder_after_new_weights_or_an_edited_pair_file(
    tmp_path, model_dir
):
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"question": "What is 2 + 2?", "answer_a": "4", "answer_b": "5", "label": 1},
        {"question": "Capital of France?", "answer_a": "Rome", "answer_b": "Paris", "label": 2},
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "judge"
    first = run_judge(pairs, out, model=str(model_dir), device="cpu")
    assert first.computed == 2
    again = run_judge(pairs, out, model=str(model_dir), device="cpu")
    assert again.computed == 0 and again.reused == 2
    tiny_folder(model_dir, seed=2)
    with pytest.raises(ConfigMismatchError, match=r"identity\.model\.weights"):
        run_judge(pairs, out, model=str(model_dir), device="cpu")  # finished, checked anyway
    tiny_folder(model_dir, seed=0)  # the first weights again: the folder is theirs
    assert run_judge(pairs, out, model=str(model_dir), device="cpu").computed == 0
    cfg = model_dir / "tokenizer_config.json"
    before = _set_json(cfg, eos_token="<|endoftext|>")
    with pytest.raises(ConfigMismatchError, match=r"identity\.tokenizer: "):
        run_judge(pairs, out, model=str(model_dir), device="cpu")
    cfg.write_text(before)
    pairs.write_text(pairs.read_text().replace('"5"', '"six"'))
    with pytest.raises(ConfigMismatchError, match=r"inputs\.data: "):
        run_judge(pairs, out, model=str(model_dir), device="cpu")
    fresh = run_judge(pairs, out, model=str(model_dir), device="cpu", restart=True)
    assert fresh.computed == 2 and len(_lines(out / "judgments.jsonl")) == 2


def test_a_loaded_backend_runs_the_sweep_as_its_name_does(tmp_path, tiny_dir):
    from ragfix.backends import BackendRef, load_backend
    from ragfix.backends.orders import OrderOptions, marginalize_orders

    loaded = load_backend("vanilla", model=str(tiny_dir), device="cpu")
    by_name, _ = _sweep(tmp_path / "name", tiny_dir, limit=2)
    seen = []
    by_backend = run_sweep(
        NQ, tmp_path / "loaded", backend=loaded, num_docs=2, limit=2, references=False,
        on_record=seen.append,
    )  # fmt: skip
    keep = ("cell_id", "answer", "correct", "prompt")
    mine, theirs = (run_records(tmp_path / d) for d in ("loaded", "name"))
    assert len(seen) == 4 and [{k: r[k] for k in keep} for r in mine] == [
        {k: r[k] for k in keep} for r in theirs
    ]
    assert by_backend["curves"] == by_name["curves"]
    assert _sweep(tmp_path / "loaded", tiny_dir, limit=2)[1] == []  # resumed under its name
    for settings, named in (({"adapter": "a"}, "adapter"), ({"dtype": "float32"}, "dtype")):
        with pytest.raises(ConfigError, match=f"brings its own settings: {named} not with it"):
            run_sweep(NQ, tmp_path / "x", backend=loaded, **settings)
    with pytest.raises(ConfigError, match="no worker processes"):
        run_sweep(NQ, tmp_path / "x", backend=loaded, workers=2)
    ref = BackendRef.of(marginalize_orders(loaded, OrderOptions(orders=2)))
    assert (ref.name, ref.orders["orders"], ref.options) == ("vanilla", 2, {})


def test_a_loaded_backend_runs_the_pipeline_and_the_judge_as_its_name_does(
    tmp_path, tiny_dir, small_corpus
):
    from ragfix.backends import load_backend

    loaded = load_backend("vanilla", model=str(tiny_dir), device="cpu")
    corpus, questions = small_corpus
    pipe = dict(corpus=corpus, questions=questions, strategies=["none"], top_k=2)
    run_pipeline_sweep(out=tmp_path / "p-name", model=str(tiny_dir), device="cpu", **pipe)
    run_pipeline_sweep(out=tmp_path / "p-loaded", backend=loaded, **pipe)
    keep = ("cell_id", "answer", "correct", "prompt")
    mine, theirs = (run_records(tmp_path / d) for d in ("p-loaded", "p-name"))
    assert len(mine) == 2 and [{k: r[k] for k in keep} for r in mine] == [
        {k: r[k] for k in keep} for r in theirs
    ]
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"question": "2 + 2?", "answer_a": "4", "answer_b": "5", "label": 1}]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_judge(pairs, tmp_path / "j-name", model=str(tiny_dir), device="cpu")
    run_judge(pairs, tmp_path / "j-loaded", backend=loaded)
    mine, theirs = (_lines(tmp_path / d / "judgments.jsonl") for d in ("j-loaded", "j-name"))
    for r in (*mine, *theirs):
        r.pop("seconds", None)
    assert len(mine) == 1 and mine == theirs
    with pytest.raises(ConfigError, match="brings its own settings: model, dtype not with it"):
        run_judge(pairs, tmp_path / "x", backend=loaded, model="other", dtype="float32")
    with pytest.raises(ConfigError, match="brings its own settings: orders not with it"):
        run_pipeline_sweep(out=tmp_path / "x", backend=loaded, orders={"orders": 2}, **pipe)


def test_each_run_validates_its_backend_options_once(tmp_path, tiny_dir, small_corpus, monkeypatch):
    import ragfix.backends as backends
    from ragfix.backends import BackendRef

    calls = []
    real = backends.validate_backend
    monkeypatch.setattr(
        backends, "validate_backend", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        json.dumps({"question": "2 + 2?", "answer_a": "4", "answer_b": "5", "label": 1}) + "\n"
    )
    corpus, questions = small_corpus
    runs = {
        "sweep": lambda: _sweep(tmp_path / "sweep", tiny_dir, limit=1),
        "pipeline": lambda: run_pipeline_sweep(
            corpus=corpus, questions=questions, out=tmp_path / "pipe", strategies=["none"], top_k=2,
            model=str(tiny_dir), device="cpu",
        ),
        "judge": lambda: run_judge(pairs, tmp_path / "judge", model=str(tiny_dir), device="cpu"),
    }  # fmt: skip
    for name, go in runs.items():
        calls.clear()
        go()
        assert len(calls) == 1, name
    # a checked reference (what the CLI builds) is not validated again, and its runs are the
    # same runs as by name: each folder resumes with nothing to compute
    ref = BackendRef(model=str(tiny_dir), device="cpu")
    calls.clear()
    ref.check()
    seen = []
    run_sweep(
        NQ, tmp_path / "sweep", backend=ref, num_docs=2, limit=1, workers=1, references=False,
        on_record=seen.append,
    )  # fmt: skip
    pipe = run_pipeline_sweep(
        corpus=corpus, questions=questions, out=tmp_path / "pipe", strategies=["none"], top_k=2,
        backend=ref,
    )  # fmt: skip
    judged = run_judge(pairs, tmp_path / "judge", backend=ref)
    assert len(calls) == 1 and seen == [] and judged.computed == 0 and judged.reused == 1
    assert pipe["cells"] == len(run_records(tmp_path / "pipe")) == 2
    with pytest.raises(ConfigError, match="a backend reference brings its own settings: dtype"):
        run_sweep(NQ, tmp_path / "x", backend=ref, dtype="float32")


def test_the_judge_refuses_a_backend_reference_with_orders(tmp_path):
    """A judge's prompt holds two answers, no passages: a reference marginalized over orders is
    refused in one line before any file is read or model loaded."""
    from ragfix.backends import BackendRef

    ref = BackendRef(orders={"orders": 2})
    with pytest.raises(ConfigError, match="no passages to reorder"):
        run_judge(tmp_path / "missing.jsonl", tmp_path / "judge", backend=ref)
    assert not (tmp_path / "judge").exists()


# ------------------------------------------------------------------ perplexity
def test_perplexity_resumes_by_window_and_refuses_new_weights_or_text(tmp_path, model_dir):
    data = tmp_path / "texts.jsonl"
    words = " ".join(f"word{i} and more text" for i in range(200))
    data.write_text(json.dumps({"text": words}) + "\n")
    out = tmp_path / "ppl"
    steps = []

    def ppl(**kw):
        return run_ppl(
            data,
            model=str(model_dir),
            train_window=16,
            ratios=(1.0,),
            methods=("vanilla",),
            device="cpu",
            out=out,
            on_step=steps.append,
            **kw,
        )

    first = ppl(windows=range(2))
    assert len(_lines(out / "windows.jsonl")) == 2
    more = ppl(windows=range(3))  # one window more: the first two are reused
    assert len(_lines(out / "windows.jsonl")) == 3
    assert more["rows"][0]["window_nll"][:2] == first["rows"][0]["window_nll"]
    tiny_folder(model_dir, seed=3)
    with pytest.raises(ConfigMismatchError, match=r"identity\.model\.weights"):
        ppl(windows=range(3))
    tiny_folder(model_dir, seed=0)
    cfg = model_dir / "tokenizer_config.json"
    before = _set_json(cfg, eos_token="<|endoftext|>")
    with pytest.raises(ConfigMismatchError, match=r"identity\.tokenizer: "):
        ppl(windows=range(3))
    cfg.write_text(before)
    data.write_text(json.dumps({"text": words.replace("word1 ", "word one ")}) + "\n")
    with pytest.raises(ConfigMismatchError, match=r"inputs\.data: "):
        ppl(windows=range(3))
    again = ppl(windows=range(3), restart=True)
    assert len(_lines(out / "windows.jsonl")) == 3
    assert again["rows"][0]["window_nll"] != more["rows"][0]["window_nll"]


def test_a_report_of_a_summary_without_its_cells_is_refused(tmp_path, tiny_dir):
    out = tmp_path / "run"
    _sweep(out, tiny_dir, limit=1)
    summary = json.loads((out / "summary.json").read_text())
    del summary["cell_ids"]
    (out / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(DataError, match="cell_ids: written by an earlier ragfix"):
        load_run(out)


# ------------------------------------------------------------------ the driver
TEXTS = ["The cat sat on the mat.", "Paris is in France.", "Two and two make four.", "Hello."]


class _Scores(RunKind):
    """A run kind of four cells, each the summed log-probability of a short text under the
    backend; ``stop_after`` raises Ctrl-C once that many records of this call are stored."""

    def __init__(self, ref, stop_after=None):
        self.config = RunConfig(run="scores", backend_ref=ref)
        self.stop_after = stop_after

    def folder(self, out):
        return RunFolder(out, self.config, results="results.jsonl", key="cell_id")

    def cells(self):
        return [(f"c{i}", text) for i, text in enumerate(TEXTS)]

    def compute(self, todo, store, batch_size):
        for n, text in enumerate(todo):
            if n == self.stop_after:
                raise KeyboardInterrupt
            logp = self.backend.token_logprobs(self.backend.tokenize(text))
            store({"cell_id": f"c{TEXTS.index(text)}", "correct": True, "logp": float(logp.sum())})

    def summarize(self, folder, records):
        return records


def test_the_driver_resumes_in_one_line_and_stores_what_arrived_before_ctrl_c(tmp_path, tiny_dir):
    from io import StringIO

    from rich.console import Console

    from ragfix.backends import BackendRef
    from ragfix.errors import Interrupted

    ref = BackendRef(model=str(tiny_dir), device="cpu")
    out = tmp_path / "run"
    stored = f"2 cell(s) computed by this run are stored in {out}"
    with pytest.raises(Interrupted, match=f"^{re.escape(stored)}$"):
        run(_Scores(ref, stop_after=2), ref, out)
    assert [r["cell_id"] for r in _lines(out / "results.jsonl")] == ["c0", "c1"]
    text = StringIO()
    records = run(_Scores(ref), ref, out, console=Console(file=text, width=200))
    resumed = [x for x in text.getvalue().splitlines() if x.startswith("resuming:")]
    assert resumed == ["resuming: 2 of 4 cells already done"]
    assert [r["cell_id"] for r in records] == ["c0", "c1", "c2", "c3"]
    assert len(_lines(out / "results.jsonl")) == 4


def test_the_driver_gives_the_same_records_from_a_loaded_backend_and_a_reference(
    tmp_path, tiny_dir
):
    from ragfix.backends import BackendRef

    ref = BackendRef(model=str(tiny_dir), device="cpu")
    by_ref = run(_Scores(ref), ref, tmp_path / "ref")
    loaded = ref.load(shared=False)
    by_backend = run(_Scores(ref), loaded, tmp_path / "loaded")
    assert by_backend == by_ref and all(r["logp"] < 0 for r in by_ref)
    assert _lines(tmp_path / "ref" / "results.jsonl") == _lines(
        tmp_path / "loaded" / "results.jsonl"
    )
    # the folder is bound to the backend's identity either way: the same folder resumes
    assert run(_Scores(ref), loaded, tmp_path / "ref") == by_ref
