"""``ragfix bench methods``: the benchmark run for real on a tiny seeded model with SmolLM2's
tokenizer (every row, the ratios' baseline, the token counts: the mechanism, not what the model
reads), and the backend names checked before anything is read."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from conftest import data_file, tiny_folder
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.errors import ConfigError

KV = "litm_kv_retrieval_140_keys.jsonl.gz"


def test_bench_methods_measures_every_backend_against_vanilla(tiny_dir, tmp_path):
    from ragfix.backends import load_backend
    from ragfix.backends.set_based import SetBasedBackend
    from ragfix.bench.methods import bench_methods
    from ragfix.connectors.litm import load_samples
    from ragfix.eval.results import write_benchmark
    from ragfix.tasks import task_prompt

    path = data_file(KV)
    seen = []
    (table, growth), details = bench_methods(
        ["vanilla", "set-based"],
        [4, 6],
        limit=1,
        model=tiny_dir,
        device="cpu",
        data=path,
        finished=lambda tables, d: seen.append((tables, d)),
    )
    rows, more = details["measurements"][:2], details["measurements"][2:]
    # a run cut after 4 passages would have kept them: the 4-passage rows, as the whole run
    [(kept, kept_details)] = seen
    assert kept_details["num_docs_done"] == [4] and details["num_docs_done"] == [4, 6]
    assert kept_details["measurements"] == rows and kept[0].rows == table.rows[:2]
    assert [(r["backend"], r["num_docs"]) for r in rows] == [("vanilla", 4), ("set-based", 4)]
    assert [row[:2] for row in table.rows[:2]] == [["vanilla", "4"], ["set-based", "4"]]
    # the growth exponent is the slope through the two lengths; the 8B tensors from the shapes
    for r4, r6, row in zip(rows, more, growth.rows, strict=True):
        t4, t6 = r4["prompt_tokens_mean"], r6["prompt_tokens_mean"]
        a = math.log(r6["prefill_s_median"] / r4["prefill_s_median"]) / math.log(t6 / t4)
        assert row[0] == r4["backend"] and row[1] == f"{a:.2f}" and row[3] == f"{t6:,.0f}"
        assert row[4] == f"{2 * 32 * 8 * 128 * t6 * 2 / 2**20:,.0f}"
    assert growth.rows[0][5:] == ["none", ""]
    assert growth.rows[1][6] == f"{more[1]['prompt_tokens_mean'] ** 2 * 2 / 2**20:,.0f}"
    assert table.headers == [
        "backend", "passages", "prompt tokens", "prefill s", "×vanilla", "generate s",
        "×vanilla", "peak MiB", "×vanilla", "decode ms/token", "×vanilla",
    ]  # fmt: skip
    vanilla, set_based = rows
    assert vanilla["prefill_x"] == vanilla["generate_x"] == 1.0
    assert vanilla["peak_x"] == (1.0 if vanilla["peak_mib"] else None)
    assert table.rows[0][4] == table.rows[0][6] == "1.00"
    # the prompt of record 0 with the gold pair in the middle of 4 (0-based position 1), as
    # each backend encodes it
    [sample] = load_samples(path, 4, limit=1)
    prompt = task_prompt(sample, sample.passages_with_gold_at(1))
    plain = load_backend("vanilla", model=tiny_dir, device="cpu")
    assert vanilla["prompt_tokens"] == [len(plain.encode(prompt))]
    set_ids = SetBasedBackend(plain.model, plain.tokenizer).encode(prompt)
    assert set_based["prompt_tokens"] == [len(set_ids)]
    for r in rows:
        assert len(r["prefill_s"]) == len(r["generate_s"]) == len(r["prefill_mib"]) == 1
        assert r["prefill_s_median"] > 0 and r["generate_s_median"] > 0
        assert 1 <= r["generated_tokens"][0] <= details["new_tokens"] == 8
        assert r["peak_mib"] is not None and r["peak_mib"] >= 0  # Linux: /proc/self/status
    assert set_based["prefill_x"] == set_based["prefill_s_median"] / vanilla["prefill_s_median"]
    # the result file keeps the table and the raw figures
    out = write_benchmark(tmp_path / "bench.json", table, **details)
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads(json.dumps(out))


def test_backends_are_checked_before_anything_is_read_an_unknown_one_in_one_line(
    monkeypatch, tmp_path
):
    import ragfix.backends
    import ragfix.connectors.litm
    from ragfix.bench.methods import bench_methods, check_backends

    # vanilla, the ratios' baseline, is measured first whether named or not; each name once
    assert check_backends(["set-based", "vanilla", "set-based"]) == ["vanilla", "set-based"]

    def never(*args, **kwargs):
        raise AssertionError("nothing is read or loaded before the backends are checked")

    monkeypatch.setattr(ragfix.backends, "load_backend", never)
    monkeypatch.setattr(ragfix.connectors.litm, "load_samples", never)
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ConfigError) as e:
        bench_methods(["set-based", "no-such"], [4], limit=1, device="cpu", data=missing)
    assert str(e.value).startswith("--backends: unknown backend 'no-such'; choose from: ")
    assert "set-based" in str(e.value) and "\n" not in str(e.value)

    args = ["bench", "methods", "--backends", "vanilla,no-such", "--data", str(missing)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    [line] = res.output.strip().splitlines()
    assert line.startswith("error: --backends: unknown backend 'no-such'; choose from: ")


def test_bench_methods_adds_order_marginalization_as_one_more_row(tiny_dir):
    """``orders=2``: a ``vanilla --orders 2`` row per aggregator on the same prompt, whose
    prompt is vanilla's (the wrapper encodes with the wrapped backend) and whose generation
    answers both orders; ``orders=1``, and aggregators without orders, are refused before
    anything is loaded."""
    from ragfix.bench.methods import bench_methods
    from ragfix.errors import ConfigError

    (table, _), details = bench_methods(
        ["vanilla"], [4], limit=1, model=tiny_dir, device="cpu", data=data_file(KV), orders=2,
        aggregates=["max", "score-max"],
    )  # fmt: skip
    vanilla, marginal, scored = details["measurements"]
    assert [r[0] for r in table.rows] == [
        "vanilla",
        "vanilla --orders 2 --orders-aggregate max",
        "vanilla --orders 2 --orders-aggregate score-max",
    ]
    assert scored["generated_tokens"] == marginal["generated_tokens"]  # the same answers
    assert marginal["prompt_tokens"] == vanilla["prompt_tokens"]
    assert marginal["generate_x"] == marginal["generate_s_median"] / vanilla["generate_s_median"]
    assert 1 <= marginal["generated_tokens"][0] <= 2 * details["new_tokens"]
    with pytest.raises(ConfigError, match="--orders 1"):
        bench_methods(["vanilla"], [4], data="missing.jsonl", orders=1)
    with pytest.raises(ConfigError, match="give --orders"):
        bench_methods(["vanilla"], [4], data="missing.jsonl", aggregates=["max"])


def test_bench_methods_measures_each_backend_in_each_dtype_against_the_first(tmp_path):
    """``dtypes=("float32", "bfloat16")``: every backend loaded in each dtype, rows named
    ``backend · dtype`` with their method and dtype, every ratio to vanilla in float32, the
    decode time per token from the prompt's own figures; a dtype named twice, and orders with
    several dtypes, refused before anything is loaded."""
    from ragfix.backends import load_backend
    from ragfix.bench.methods import bench_methods
    from ragfix.connectors.litm import load_samples
    from ragfix.tasks import task_prompt

    folder = str(tiny_folder(tmp_path / "tiny"))
    prompts = [
        task_prompt(s, s.passages_with_gold_at(1)) for s in load_samples(data_file(KV), 4, 2)
    ]
    (table, growth), details = bench_methods(
        ["vanilla", "set-based"], [4], limit=2, model=folder, device="cpu",
        data=data_file(KV), dtypes=("float32", "bfloat16"),
    )  # fmt: skip
    rows = details["measurements"]
    labels = ["vanilla · float32", "set-based · float32", "vanilla · bfloat16"]
    labels += ["set-based · bfloat16"]
    assert [r["backend"] for r in rows] == [row[0] for row in table.rows] == labels
    assert [(r["method"], r["dtype"]) for r in rows] == [
        (m, d) for d in ("float32", "bfloat16") for m in ("vanilla", "set-based")
    ]
    assert details["dtypes"] == ["float32", "bfloat16"]
    base = rows[0]
    for r, row in zip(rows, table.rows, strict=True):
        assert r["prefill_x"] == r["prefill_s_median"] / base["prefill_s_median"]
        if r["method"] == "set-based":  # no step decoding: no decode figure
            assert r["decode_ms"] == r["decode_steps"] == [None, None] and row[9:] == ["n/a", "n/a"]
            continue
        # the steps timed: those the backend's step decoder takes after the prompt's prefill
        backend = load_backend("vanilla", model=folder, device="cpu", dtype=r["dtype"])
        for p, prompt in enumerate(prompts):
            decoder = backend.decoder()
            row_id, done, calls = (
                decoder.add(prompt, max_new_tokens=33, stop_at_newline=False),
                {},
                0,
            )
            while row_id not in done:
                done.update(decoder.step())
                calls += 1
            assert r["decode_steps"][p] == calls >= 2
            assert r["decode_ms"][p] > 0
        assert r["decode_ms_median"] == statistics.median(r["decode_ms"])
        assert r["decode_x"] == r["decode_ms_median"] / base["decode_ms_median"]
        assert row[9:] == [f"{r['decode_ms_median']:.1f}", f"{r['decode_x']:.2f}"]
    assert "ratio to vanilla · float32" in table.lines[0]
    # set-based's quadratic mask is read from its method, whatever its row's name
    assert [row[5] for row in growth.rows] == ["none", "block mask [T, T] bf16"] * 2
    with pytest.raises(ConfigError, match="named twice"):
        bench_methods(
            ["vanilla"], [4], data="missing.jsonl", device="cpu", dtypes=("auto", "float32")
        )
    with pytest.raises(ConfigError, match="one dtype"):
        bench_methods(
            ["vanilla"], [4], data="missing.jsonl", device="cpu", orders=2,
            dtypes=("float32", "bfloat16"),
        )  # fmt: skip


def test_the_command_keeps_each_number_of_passages_in_its_json_and_takes_dtypes(tmp_path):
    """``--num-docs 4,6 --json F --dtype float32,bfloat16``: the file is rewritten after 4
    passages and at the end (the rows of both, in both dtypes); a dtype typo is one line."""
    folder = str(tiny_folder(tmp_path / "tiny"))
    out = tmp_path / "bench.json"
    args = ["bench", "methods", "--backends", "vanilla", "--num-docs", "4,6", "--limit", "1"]
    args += ["--model", folder, "--device", "cpu", "--data", str(data_file(KV)), "--json"]
    res = CliRunner().invoke(app, [*args, str(out), "--dtype", "float32,bfloat16"])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["num_docs_done"] == [4, 6] and result["dtypes"] == ["float32", "bfloat16"]
    assert [(r[0], r[1]) for r in result["rows"]] == [
        (f"vanilla · {d}", n) for n in ("4", "6") for d in ("float32", "bfloat16")
    ]
    res = CliRunner().invoke(app, [*args, str(out), "--dtype", "float32,bf16"])
    assert res.exit_code == 2
    assert res.output.strip() == "error: dtype 'bf16': expected auto, float32, bfloat16, float16"


def test_decode_steps_are_the_forward_passes_after_the_prefill_when_eos_is_the_pad(tmp_path):
    """An answer that ends on EOS, the pad token too (as SmolLM2's tokenizer has it): the steps
    timed are the decoding forward passes, counted by a hook on the model, not the answer's
    tokens (which leave out the EOS)."""
    import torch

    from ragfix.backends import load_backend
    from ragfix.bench.methods import _decode_steps

    backend = load_backend("vanilla", model=str(tiny_folder(tmp_path)), device="cpu")
    prompt = "Name three colours of the rainbow."
    tokens = backend.generate([prompt], max_new_tokens=8, stop_at_newline=False)[0].token_ids
    end = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 2)
    tok = backend.tokenizer
    tok.eos_token = tok.pad_token = tok.convert_ids_to_tokens(tokens[end])
    forwards = []
    backend.model.register_forward_hook(lambda *_: forwards.append(1))
    got = _decode_steps(backend, prompt, torch.device("cpu"))
    assert got["decode_steps"] == end == len(forwards) - 1  # the prefill, then one a step
    assert got["decode_ms"] > 0
