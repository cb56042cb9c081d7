"""The package as a user installs it: build the wheel from the checkout, install it in a fresh
virtual environment and use the bundled data from outside the source tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A virtual environment with the wheel of this checkout installed (no source tree on its
    path); the dependencies come from the test's own environment through a ``.pth`` line."""
    tmp = tmp_path_factory.mktemp("wheel")
    # the checkout as git sees it (tracked and new files), without build leftovers
    src = tmp / "src"
    listed = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO).stdout
    for rel in filter(None, listed.split("\0")):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", tmp / "dist", src],
        cwd=tmp,
        PIP_NO_INDEX="1",
    )
    (wheel,) = (tmp / "dist").glob("ragfix-*.whl")
    env = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", env], cwd=tmp)
    python = env / "bin" / "python"
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp)
    site_dir = Path(site.stdout.strip())
    # the test environment's packages (torch, transformers, ...) without its editable ragfix:
    # a plain path line does not run that environment's own .pth hooks
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site_dir / "test-deps.pth").write_text("\n".join(deps) + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q"]
        + ["--force-reinstall", "--no-index", wheel],
        cwd=tmp,
    )
    return env


def test_bundled_data_resolves_inside_the_installed_wheel(venv, tmp_path):
    code = (
        "import json, ragfix, sysconfig\n"
        "from ragfix.bundled import BUNDLED, DEMO_CORPUS, DEMO_QUESTIONS, bundled_path\n"
        "from ragfix.connectors.corpus import resolve_demo\n"
        "from pathlib import Path\n"
        "paths = [bundled_path(n) for n in BUNDLED] + [DEMO_CORPUS, DEMO_QUESTIONS,\n"
        "    resolve_demo(Path('demo'), 'corpus'), resolve_demo(Path('demo'), 'questions')]\n"
        "print(json.dumps({'site': sysconfig.get_path('purelib'), 'ragfix': ragfix.__file__,\n"
        "    'files': [[str(p), p.is_file(), p.stat().st_size] for p in paths]}))\n"
    )
    out = json.loads(_run([venv / "bin" / "python", "-c", code], cwd=tmp_path).stdout)
    site = Path(out["site"])
    assert Path(out["ragfix"]).is_relative_to(site)
    names = [Path(f).name for f, _, _ in out["files"]]
    assert names == [
        "nq_10docs_sample.jsonl.gz",
        "kv_16pairs_sample.jsonl.gz",
        "nq_demo_corpus.jsonl",
        "nq_demo_questions.jsonl",
        "nq_demo_corpus.jsonl",
        "nq_demo_questions.jsonl",
    ]
    for f, is_file, size in out["files"]:
        assert Path(f).is_relative_to(site / "ragfix" / "data") and is_file
        assert size == (REPO / "ragfix" / "data" / Path(f).name).stat().st_size


def test_installed_cli_runs_the_demo_pipeline(venv, tmp_path):
    from ragfix.io import cache_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    if (cache_dir() / "models").is_dir():  # reuse the converted SmolLM2, build the index anew
        (cache / "models").symlink_to(cache_dir() / "models")
    out = tmp_path / "run"
    args = [
        "eval-pipeline",
        "--corpus",
        "demo",
        "--questions",
        "demo",
        "--limit",
        "1",
        "--num-docs",
        "2",
    ]
    args += ["--positions", "0", "--device", "cpu", "--out", out]
    _run([venv / "bin" / "ragfix", *args], cwd=tmp_path, timeout=600, RAGFIX_CACHE=str(cache))
    records = [json.loads(x) for x in next(out.rglob("results.jsonl")).read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    assert (rec["sample_id"], rec["position"], rec["num_docs"]) == ("nq-0200", 0, 2)
    assert rec["correct"] is True  # "... a presidential representative democratic republic"
    assert list((cache / "indexes").iterdir())  # the bundled corpus was indexed in the cache
    page = tmp_path / "page.html"  # the page's template ships in the wheel
    _run(
        [venv / "bin" / "ragfix", "report", out, "-o", tmp_path / "c.png", "--html", page], tmp_path
    )
    assert '<script type="application/json" id="cells">' in page.read_text()
    assert rec["question"] in page.read_text() and rec["prompt"]["text"]
