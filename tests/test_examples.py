"""The examples a new user copies (issue 14): ``examples/quickstart.py`` runs offline as a fresh
process and does what it prints, and the README's quick start is that file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ragfix.reorder import lost_in_the_middle_order

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.py"
README_MARK = "<!-- examples/quickstart.py -->"


def _code(example: Path) -> str:
    """The example's code after its module docstring (what the README shows)."""
    text = example.read_text()
    return text[text.index('"""', 3) + 3 :].lstrip("\n")


def test_quickstart_runs_offline_and_reports_what_it_did(tmp_path):
    """A fresh process in an empty folder: the answer, the placement of the 10 retrieved chunks
    (lost-in-the-middle order) and the sweep's curve, each checked against what it wrote."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    answer = re.search(r"^answer: (.*)$", out, re.M)
    assert answer is not None and "Walter Pauk" in answer.group(1)
    ranks = [int(r) for r in re.findall(r"prompt position \d+: retrieval rank (\d+): ", out)]
    assert ranks == lost_in_the_middle_order(10) == [0, 2, 4, 6, 8, 9, 7, 5, 3, 1]
    assert "prompt position 0: retrieval rank 0: Cornell Notes" in out  # the embedder found it
    run = tmp_path / "runs" / "quickstart"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategies"] == ["none", "lost-in-the-middle"]
    assert summary["questions"] == 2 and summary["num_docs"] == 10 and summary["cells"] == 8
    assert len((run / "results.jsonl").read_text().splitlines()) == 8
    assert len(summary["curves"]) == 2
    for label, curve in summary["curves"].items():
        acc = {p["position"]: p["accuracy"] for p in curve["positions"]}
        assert sorted(acc) == [0, 9] and all(p["n"] == 2 for p in curve["positions"])
        assert f"{label}: gold at retrieval rank 0: {acc[0]:.2f}, at rank 9: {acc[9]:.2f}" in out


def test_readme_quick_start_is_the_example():
    """The README's quick start block (after the ``<!-- examples/quickstart.py -->`` marker) is
    exactly the code the test above runs."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(re.escape(README_MARK) + r"\s*```python\n(.*?)```", readme, re.S)
    assert block is not None, f"README.md has no quick start block marked {README_MARK}"
    assert block.group(1) == _code(QUICKSTART)


def test_every_other_python_block_of_the_readme_runs(tmp_path):
    """Every other ``python`` block of the README runs as written, as a fresh process in a
    folder where ``data/`` is the repository's, and does what it says."""
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if b != _code(QUICKSTART)]
    assert len(blocks) == 2, "a new README code block needs its checks here"
    (tmp_path / "data").symlink_to(ROOT / "data")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    outputs = []
    for code in blocks:
        res = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr[-3000:]
        outputs.append(res.stdout)
    answer, score = outputs[0].rstrip("\n").rsplit(" ", 1)
    assert score in ("True", "False") and answer.strip()  # an answer and its best_subspan_em
    kv = json.loads((tmp_path / "runs" / "kv" / "summary.json").read_text())
    assert kv["cells"] == 2 and [p["position"] for p in kv["curves"]["vanilla"]["positions"]] == [
        0,
        7,
    ]
    judge = json.loads((tmp_path / "runs" / "judge" / "summary.json").read_text())
    assert judge["config"]["model"] == "smollm2"
