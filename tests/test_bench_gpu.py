"""``ragfix bench gpu``: it refuses without CUDA, and its steps (the family mechanism tests run by
pytest on the device, SmolLM2's held-out KV-8 sweep compared as ``ragfix report`` compares) run
end to end on the CPU with a narrowed test selection and one record (the sweep on a tiny seeded
model: the test checks the steps, not the model's answers)."""

from __future__ import annotations

import json

import torch
from conftest import ROOT
from typer.testing import CliRunner

from ragfix.bench.gpu import gpu_check
from ragfix.cli.app import app


def test_without_cuda_the_command_refuses_in_one_line(tmp_path):
    assert not torch.cuda.is_available()  # this test is the CPU machine's
    res = CliRunner().invoke(app, ["bench", "gpu", "--out", str(tmp_path)])
    assert res.exit_code != 0
    assert "no CUDA device visible (asked for cuda)" in res.output
    assert not list(tmp_path.iterdir())  # nothing filed as a GPU figure


def test_the_steps_write_their_result_files(tmp_path, tiny_dir, monkeypatch):
    # the steps' plumbing, not SmolLM2's answers: the KV-8 sweep runs the tiny seeded model
    # (the step's own run_sweep call, its model argument set to the tiny folder)
    import ragfix.eval.sweep_run

    sweep, models = ragfix.eval.sweep_run.run_sweep, []

    def on_tiny(*args, **kwargs):
        models.append(kwargs.setdefault("model", tiny_dir))
        return sweep(*args, **kwargs)

    monkeypatch.setattr(ragfix.eval.sweep_run, "run_sweep", on_tiny)
    result = gpu_check(
        tmp_path / "results",
        tmp_path / "runs",
        device="cpu",
        records="200:201",
        backends=("vanilla",),
        select="order_invariance and llama and fp32 and pine",  # one test, one of the cheapest
        root=ROOT,
    )
    mech = json.loads((tmp_path / "results" / "gpu-mechanism.json").read_text())
    assert mech == result["mechanism"]
    assert (mech["passed"], mech["failed"], mech["exit"]) == (1, 0, 0)
    comparison = json.loads((tmp_path / "results" / "gpu-kv8-test30-methods.json").read_text())
    (run,) = comparison["runs"]
    curve = run["curves"]["vanilla"]
    assert curve["cells"] == 8 and len(curve["positions"]) == 8
    records = (tmp_path / "runs" / "kv8-vanilla" / "results.jsonl").read_text().splitlines()
    assert len(records) == 8 and models == [tiny_dir]
