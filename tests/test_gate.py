"""The position-bias gate for CI (issue 58): ``--gate`` conditions on a real run's curve exit 1
with the failing figure and its interval, and pass only when the whole interval clears the
threshold."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.errors import ConfigError
from ragfix.eval.gate import Condition, parse_gates

SWEEP = ["kv-sample", "--num-docs", "2", "--positions", "0,1", "--limit", "2", "--workers", "1",
         "--device", "cpu"]  # fmt: skip


def test_conditions_are_parsed_and_refused_in_one_line():
    assert [str(c) for c in parse_gates(["worst>=0.3", " gap <= .1", "diff>=-0.05"])] == [
        "worst>=0.3",
        "gap<=0.1",
        "diff>=-0.05",
    ]
    for bad in ("worst>0.3", "best>=0.3", "worst>=1.5", "mean>=abc", "gap<=-0.1"):
        with pytest.raises(ConfigError, match=r"^--gate "):
            Condition.parse(bad)


def test_an_estimate_that_meets_the_threshold_without_its_interval_fails_saying_so():
    """A committed report (Gemma 3 270M over three orders against vanilla, 20 SQuAD test
    questions): each condition whose estimate meets the threshold while its 95% interval does
    not fails with "cannot show it" and the figure's interval as the report has them; one whose
    interval clears the threshold passes; one whose estimate misses it is "below"."""
    from ragfix.eval.gate import gate_failures

    comparison = json.loads((ROOT / "results/squad-test20-k10-gemma3-orders3-max.json").read_text())
    run = comparison["runs"][-1]
    curve, pair = run["curves"]["vanilla"], comparison["paired"][0]
    label = f"{run['name']}:vanilla"
    figures = {
        "mean>=0.25": (label, curve["mean"], curve["mean_ci"], curve["samples"]),
        "worst>=0.15": (
            f"{label} (position {curve['worst_position']})",
            curve["worst"],
            curve["worst_ci"],
            curve["samples"],
        ),
        "gap<=0.3": (label, curve["gap"], curve["gap_ci"], curve["samples"]),
        "diff>=0": (
            f"{pair['other']} vs {pair['baseline']}",
            pair["mean_diff"],
            pair["mean_diff_ci"],
            pair["samples"],
        ),
    }
    for text, (name, value, ci, n) in figures.items():
        (c,) = parse_gates([text])
        met = value >= c.threshold if c.op == ">=" else value <= c.threshold
        assert met and not (ci["low"] >= c.threshold if c.op == ">=" else ci["high"] <= c.threshold)
        assert gate_failures(comparison, [c]) == [
            f"gate {c} failed: {name} {c.figure} {value:.3f} (95% CI [{ci['low']:.3f}, "
            f"{ci['high']:.3f}], {n} samples): its estimate meets {c.threshold:g} but the "
            "interval does not: 20 samples cannot show it (give more questions)"
        ]
    assert curve["gap_ci"]["high"] <= 0.45
    assert gate_failures(comparison, parse_gates(["gap<=0.45"])) == []
    (below,) = gate_failures(comparison, parse_gates(["worst>=0.5"]))
    assert below.endswith(": below 0.5") and f"worst {curve['worst']:.3f}" in below


def test_a_gate_on_a_real_sweep_exits_1_naming_the_figure_and_its_interval(tmp_path, tiny_dir):
    """A run on two KV samples of two pairs (the shared tiny model: the gate reads the figures
    of whatever run it is given, and each line is checked against ``ragfix report``'s figures):
    ``worst>=0.9`` fails with the worst position's accuracy and Wilson interval as the run's
    summary has them; ``worst>=0`` passes (its interval clears 0); against a baseline run (PINE
    over the same cells) a ``diff`` condition reads the paired interval ``ragfix report``
    writes; no diff without a pair."""
    runner = CliRunner()
    sweep = [*SWEEP, "--model", tiny_dir]
    base, other = tmp_path / "vanilla", tmp_path / "pine"
    res = runner.invoke(app, ["eval", *sweep, "--out", str(base), "--gate", "worst>=0.9"])
    assert res.exit_code == 1, res.output
    report = runner.invoke(app, ["report", str(base), "--json", str(tmp_path / "c.json"),
                                 "--out", str(tmp_path / "c.png")])  # fmt: skip
    assert report.exit_code == 0, report.output
    curve = json.loads((tmp_path / "c.json").read_text())["runs"][0]["curves"]["vanilla"]
    line = (
        f"gate worst>=0.9 failed: vanilla:vanilla (position {curve['worst_position']}) worst "
        f"{curve['worst']:.3f} (95% CI [{curve['worst_ci']['low']:.3f}, "
        f"{curve['worst_ci']['high']:.3f}], 2 samples)"
    )
    assert line in " ".join(res.output.split()), res.output
    ok = runner.invoke(app, ["report", str(base), "--out", str(tmp_path / "c.png"),
                             "--gate", "worst>=0", "--gate", "mean<=1"])  # fmt: skip
    assert ok.exit_code == 0 and "gate passed: worst>=0, mean<=1" in ok.output
    alone = runner.invoke(app, ["report", str(base), "--gate", "diff>=0"])
    assert alone.exit_code == 2 and "has no paired comparison" in alone.output
    args = ["eval", *sweep, "--backend", "pine", "--out", str(other), "--baseline", str(base)]
    res = runner.invoke(app, [*args, "--gate", "diff>=0.99"])
    assert res.exit_code == 1, res.output
    pair = runner.invoke(app, ["report", str(base), str(other), "--json", str(tmp_path / "p.json"),
                               "--out", str(tmp_path / "p.png")])  # fmt: skip
    assert pair.exit_code == 0
    [paired] = json.loads((tmp_path / "p.json").read_text())["paired"]
    ci = paired["mean_diff_ci"]
    assert (
        f"diff {paired['mean_diff']:.3f} (95% CI [{ci['low']:.3f}, {ci['high']:.3f}], 2 samples)"
        in " ".join(res.output.split())
    )
    wide = runner.invoke(app, [*args, "--gate", f"diff>={ci['low'] - 0.01:.3f}"])
    assert wide.exit_code == 0 and "gate passed" in wide.output  # resumed: every cell done
    assert runner.invoke(app, ["eval", *sweep, "--baseline", str(base)]).exit_code == 2


@pytest.mark.processes
def test_the_documented_pytest_gate_runs_and_fails_a_run_too_small_for_its_threshold(
    tmp_path, tiny_dir
):
    """docs/eval.md's pytest example, run by pytest in a project whose ``docs/`` is two pages of
    ragfix's docs, with 2 needles instead of 50 and the shared tiny model (6 cells): the gate
    cannot pass on 2 questions (even 2 of 2 right leave the interval's low end under 0.5), so
    the example's test fails with the gate's line, the worst figure and interval of the run's
    summary, in its message."""
    from ragfix.metrics import wilson_interval

    text = (ROOT / "docs" / "eval.md").read_text()
    code = re.search(r"In a pytest suite.*?```python\n(.*?)```", text, re.S).group(1)
    assert '"--needles",\n            "50",' in code
    model = '"--strategy",\n'
    assert code.count(model) == 1
    code = code.replace(model, f'"--model",\n            {tiny_dir!r},\n            {model}')
    (tmp_path / "docs").mkdir()
    for page in ("development.md", "scale-out.md"):
        shutil.copy(ROOT / "docs" / page, tmp_path / "docs" / page)
    (tmp_path / "test_gate_example.py").write_text(code.replace('"50"', '"2"'))
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": path}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_gate_example.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1 failed" in res.stdout and "gate worst>=0.5 failed: " in res.stdout, res.stdout[-3000:]
    summary = json.loads((tmp_path / "runs" / "gate" / "summary.json").read_text())
    assert summary["cells"] == 6 and summary["questions"] == 2
    [(name, curve)] = summary["curves"].items()
    [worst] = [p for p in curve["positions"] if p["position"] == curve["worst_position"]]
    line = (
        f"gate worst>=0.5 failed: gate:{name} (position {worst['position']}) worst "
        f"{curve['worst']:.3f} (95% CI [{worst['low']:.3f}, {worst['high']:.3f}], 2 samples)"
    )
    assert line in " ".join(res.stdout.split()), res.stdout[-3000:]
    assert wilson_interval(2, 2)[0] < 0.5  # 2 of 2 right would fail it too
