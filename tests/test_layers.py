"""The import graph of the installed package: the library never imports the evaluation, the
benchmarks or the CLI, the evaluation never imports the benchmarks, no method package imports
another, and no two modules import each other, directly or round a longer loop.

Every ``.py`` file of every package listed in ``pyproject.toml`` is read where the installed
package has it (``importlib.util.find_spec``: ``ragfix.eval`` lives in ``eval/``), and every
``import`` / ``from ... import`` in it counts, at module level or inside a function, plus the
module names a module hands to ``importlib.import_module`` or to
:func:`ragfix.lazy.lazy_exports` as string literals (the lazy names of ``ragfix/__init__.py``,
``ragfix.eval`` and ``ragfix.models``, the backend registry, the CLI's command modules).

An edge goes to the module named: ``from ragfix.eval.sweep import x`` is an edge to
``ragfix.eval.sweep``, ``from ragfix.judge import summarize`` one to ``ragfix.judge`` (its
``__init__``), ``from ragfix.eval import sweep`` one to ``ragfix.eval.sweep``. Python also runs a
package's ``__init__`` before any of its submodules; that implicit step is not an edge, so a
package ``__init__`` that re-exports its submodules (the package's façade) is not a cycle with
each of them. A submodule importing its own package's ``__init__`` is an edge, and a cycle when
that ``__init__`` imports it back.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
#: the packages above the library: nothing in the library imports them
UPPER = ("ragfix.eval", "ragfix.bench", "ragfix.cli")
#: the bottom floor (records, errors, atomic files, content fingerprints, lazy package names):
#: imports only itself
BOTTOM = ("ragfix.types", "ragfix.errors", "ragfix.io", "ragfix.fingerprint", "ragfix.lazy")
#: the model modules: import only the bottom floor and each other
MODELS = "ragfix.models"


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is a package __init__)}`` of every package in pyproject."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]
    out = {}
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        assert spec is not None and spec.submodule_search_locations, f"{pkg} is not installed"
        folder = Path(next(iter(spec.submodule_search_locations)))
        for sub in folder.iterdir():
            if (sub / "__init__.py").is_file():
                assert f"{pkg}.{sub.name}" in packages, f"{pkg}.{sub.name} is not in pyproject"
        for file in sorted(folder.glob("*.py")):
            name = pkg if file.stem == "__init__" else f"{pkg}.{file.stem}"
            out[name] = (file, file.stem == "__init__")
    return out


def _imports(name: str, file: Path, is_package: bool, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (see the module docstring)."""
    tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
    here = name if is_package else name.rpartition(".")[0]
    named: set[str] = set()
    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for a in node.names:
                full = f"{module}.{a.name}"
                named.add(full if full in known else module)
        elif (isinstance(node, ast.Attribute) and node.attr == "import_module") or (
            isinstance(node, ast.Name) and node.id == "lazy_exports"
        ):
            dynamic = True
    if dynamic:
        named.update(
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in known
        )
    out = set()
    for target in named:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, f, pkg, known) for m, (f, pkg) in mods.items()}


def _upper(module: str) -> bool:
    return any(module == u or module.startswith(u + ".") for u in UPPER)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return found


def _loop(graph: dict[str, set[str]], scc: list[str]) -> str:
    """One closed path through a cycle's modules, for the failure message."""
    members = set(scc)
    path = [scc[0]]
    while True:
        nxt = sorted(graph[path[-1]] & members)
        back = [n for n in nxt if n in path]
        if back:
            return " -> ".join([*path[path.index(back[0]) :], back[0]])
        path.append(next(n for n in nxt if n not in path))


def test_the_walk_sees_every_package():
    graph = _graph()
    for pkg in ("ragfix", "ragfix.backends", "ragfix.eval", "ragfix.bench", "ragfix.cli"):
        assert pkg in graph
    assert "ragfix.connectors" in graph and "ragfix.bench.memory" in graph["ragfix.bench.gali"]
    assert "ragfix.eval.sweep" in graph["ragfix.eval.compare"]
    assert "ragfix.cli.eval_cmd" in graph["ragfix.cli.app"]  # a dynamic import counts


def test_the_library_never_imports_eval_or_cli():
    graph = _graph()
    upward = sorted(
        f"{m} -> {t}" for m, targets in graph.items() if not _upper(m) for t in targets if _upper(t)
    )
    assert not upward, "library modules import ragfix.eval / ragfix.cli:\n" + "\n".join(upward)


def test_only_the_cli_imports_the_benchmarks():
    """``ragfix.bench`` sits above the evaluation: it imports ``ragfix.eval``, never the reverse."""
    graph = _graph()
    inward = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if not m.startswith(("ragfix.bench", "ragfix.cli"))
        for t in targets
        if t == "ragfix.bench" or t.startswith("ragfix.bench.")
    )
    assert not inward, "modules below ragfix.bench import it:\n" + "\n".join(inward)
    assert "ragfix.eval.sweep" in graph["ragfix.bench.sweep"]


def test_no_import_cycle():
    graph = _graph()
    cycles = [_loop(graph, scc) for scc in _cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_catch_a_cycle_and_an_upward_edge():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _loop(graph, ["a", "b", "c"]) == "a -> b -> c -> a"
    assert _upper("ragfix.eval.sweep") and _upper("ragfix.cli") and not _upper("ragfix.evaluate")


def _method_packages() -> set[str]:
    """The packages of the registered backends (the methods, one ``ragfix.backends.NAME`` folder
    each), vanilla's ``hf`` left out."""
    from ragfix.backends import backend_names, backend_spec

    targets = [backend_spec(b).target for b in backend_names()]
    modules = {t.split(":")[0] for t in targets if isinstance(t, str)}
    return {".".join(m.split(".")[:3]) for m in modules} - {"ragfix.backends.hf"}


def _method_of(module: str, methods: set[str]) -> str | None:
    """The method package ``module`` belongs to (itself or one of its modules), or ``None``."""
    return next((m for m in methods if module == m or module.startswith(m + ".")), None)


def _method_crossings(graph: dict[str, set[str]], methods: set[str]) -> dict[str, list[str]]:
    """Per module of a method package, the modules of other method packages it imports (none
    when the rule holds)."""
    out = {}
    for module in sorted(graph):
        mine = _method_of(module, methods)
        if mine is None:
            continue
        others = sorted(t for t in graph[module] if _method_of(t, methods) not in (None, mine))
        if others:
            out[module] = others
    return out


def test_each_method_is_one_package():
    """Every registered method is a package of ``ragfix.backends`` (its options, backend and
    calibration or tune in one folder), walked like every other module."""
    graph = _graph()
    methods = _method_packages()
    assert {"ragfix.backends.pine", "ragfix.backends.attention_sort"} <= methods
    for m in sorted(methods):
        assert m in graph, f"{m} is not a package listed in pyproject"
        assert _modules()[m][1], f"{m} is a module, not a package"
    assert "ragfix.backends.channel_scaling.calibrate" in graph
    assert "ragfix.backends.attention_sort.tune" in graph


def test_no_method_imports_another():
    """Each method package imports only the shared toolkit (``base``, ``hf``, ``decoding``,
    ``scoring``, ``family``, ``passages``, ``layout``, ``patching``) and its own modules, never
    another method's package."""
    assert _method_crossings(_graph(), _method_packages()) == {}


def test_the_method_rule_catches_one_method_importing_another():
    graph = _graph()
    methods = _method_packages()
    pine, gali = "ragfix.backends.pine.backend", "ragfix.backends.gali.options"
    graph[pine] = graph[pine] | {"ragfix.backends.set_based.options"}
    graph[gali] = graph[gali] | {"ragfix.backends.truncated", "ragfix.backends.gali.backend"}
    assert _method_crossings(graph, methods) == {
        gali: ["ragfix.backends.truncated"],
        pine: ["ragfix.backends.set_based.options"],
    }


def test_the_pipeline_engines_sit_beside_their_components():
    """Each framework's engine of the pipeline sweep is in ``ragfix.integrations`` beside its
    components, over the shared ``ragfix.integrations.engine``; the package imports neither the
    evaluation, the CLI nor the data connectors (the sweep hands the engines its cells), and the
    sweep reaches the engines through the string names of its framework registry."""
    graph = _graph()
    integrations = sorted(m for m in graph if m.startswith("ragfix.integrations"))
    for framework in ("langchain", "haystack", "llama_index"):
        module = f"ragfix.integrations.{framework}"
        assert "ragfix.integrations.engine" in graph[module]
        assert module in graph["ragfix.eval.pipeline"]
    crossing = [
        f"{m} -> {t}"
        for m in integrations
        for t in sorted(graph[m])
        if _upper(t) or t.startswith("ragfix.connectors")
    ]
    assert not crossing, "ragfix.integrations imports above the library:\n" + "\n".join(crossing)


def _floor_breaches(graph: dict[str, set[str]]) -> list[str]:
    """The edges that leave a floor: a bottom-floor module importing anything else, a model
    module (``ragfix.models`` and its modules) importing anything but the bottom floor and the
    model modules."""

    def model(m: str) -> bool:
        return m == MODELS or m.startswith(MODELS + ".")

    out = []
    for m in sorted(graph):
        if m in BOTTOM:
            out += [f"{m} -> {t}" for t in sorted(graph[m]) if t not in BOTTOM]
        elif model(m):
            out += [f"{m} -> {t}" for t in sorted(graph[m]) if t not in BOTTOM and not model(t)]
    return out


def test_the_bottom_floor_and_the_model_modules_import_only_below():
    graph = _graph()
    assert not _floor_breaches(graph), "imports that leave a floor:\n" + "\n".join(
        _floor_breaches(graph)
    )
    assert {"ragfix.models.resolve", "ragfix.models.device"} <= graph["ragfix.models.load"]
    assert "ragfix.fingerprint" in graph["ragfix.models.gguf"]
    assert "ragfix.models.load" in graph["ragfix.models"]  # the lazy names count


@pytest.mark.processes
def test_the_floor_rule_catches_an_upward_import():
    graph = _graph()
    graph["ragfix.fingerprint"] = graph["ragfix.fingerprint"] | {"ragfix.models.resolve"}
    graph["ragfix.models.device"] = graph["ragfix.models.device"] | {"ragfix.backends.base"}
    assert _floor_breaches(graph) == [
        "ragfix.fingerprint -> ragfix.models.resolve",
        "ragfix.models.device -> ragfix.backends.base",
    ]


def _heavy_after(code: str) -> list[str]:
    """Which of torch and transformers a fresh interpreter holds after running ``code``."""
    probe = f"{code}; import sys; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_fingerprints_run_folders_and_model_names_import_no_torch():
    """Content fingerprints, the run folder (:mod:`ragfix.eval.run`), model resolution, GGUF
    conversion and the thread settings import neither torch nor transformers; loading does."""
    light = (
        "import ragfix.fingerprint, ragfix.eval.run, ragfix.models, ragfix.models.resolve, "
        "ragfix.models.gguf, ragfix.models.device; from ragfix.models import REMOTE_PREFIX"
    )
    assert _heavy_after(light) == []
    assert _heavy_after("from ragfix.models import load_model") == ["torch"]
