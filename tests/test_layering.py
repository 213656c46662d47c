"""Imports only look down: drafting < artifacts < policies < envs < eval < train < demo and the cli modules.

Every `import specpilot.X` / `from specpilot.X import` in the package (lazy ones inside functions included) is
checked; the one upward import allowed is `SpeculativeDecoder.from_config` loading an exported policy.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"drafting": 0, "artifacts": 1, "policies": 2, "envs": 3, "eval": 4, "train": 5}
TOP = 6  # demo.py, cli.py and every package's cli.py: they wire commands and may import anything
ALLOWED_UPWARD = {("drafting/decoder.py", "specpilot.policies.exported")}


def _layer(rel: str) -> int:
    path = Path(rel)
    if path.name in ("cli.py", "demo.py") or path.parts[0] not in LAYERS:
        return TOP
    return LAYERS[path.parts[0]]


def _module_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "specpilot" or len(parts) == 1:
        return None
    if parts[1] in ("cli", "demo") or (len(parts) > 2 and parts[2] == "cli"):
        return TOP
    return LAYERS.get(parts[1])


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if _module_layer(f"{node.module}.{alias.name}") is not None and node.module == "specpilot"]
    return found


def package_files() -> list[str]:
    skip = {"tests", "benchmarks", ".venv", "build", "dist"}
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                  if not (set(p.relative_to(ROOT).parts) & skip) and not p.name.startswith("."))


def upward_imports() -> list[tuple[str, str]]:
    bad = []
    for rel in package_files():
        own = _layer(rel)
        for module in _imports(ROOT / rel):
            target = _module_layer(module)
            if target is not None and target > own and (rel, module) not in ALLOWED_UPWARD:
                bad.append((rel, module))
    return bad


def test_no_upward_imports():
    assert package_files(), "no package files found"
    assert upward_imports() == []


@pytest.mark.parametrize("rel,module,upward", [
    ("policies/heuristics.py", "specpilot.envs.environments", True),
    ("envs/oracle.py", "specpilot.eval.suites", True),
    ("train/grid/search.py", "specpilot.eval.runner", False),
    ("envs/cli.py", "specpilot.eval.suites", False),
    ("drafting/decoder.py", "specpilot.policies.exported", True),
    ("artifacts/grid.py", "specpilot.policies.observation", True),
    ("policies/ppo.py", "specpilot.artifacts.policies", False),
    ("drafting/pair.py", "specpilot.artifacts.run", True),
])
def test_the_checker_sees_direction(rel, module, upward):
    """The checker itself can fail: upward edges are classified as such."""
    assert (_module_layer(module) > _layer(rel)) is upward


def test_exported_decoder_loads_without_gymnasium_or_sb3():
    import subprocess
    import sys

    code = ("import sys, specpilot.policies.exported, specpilot.drafting.decoder; "
            "bad = [m for m in ('gymnasium', 'stable_baselines3', 'specpilot.envs', 'specpilot.train') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


ARTIFACTS_MAY_IMPORT = {"specpilot.drafting.files", "specpilot.drafting.errors", "specpilot.drafting.checks"}


def test_artifacts_import_only_files_errors_and_checks():
    """The run-file layer stays light: besides itself, only drafting's files / errors / checks (no torch models)."""
    bad = [(rel, m) for rel in package_files() if rel.startswith("artifacts/") for m in _imports(ROOT / rel)
           if m.startswith("specpilot.") and not m.startswith("specpilot.artifacts") and m not in ARTIFACTS_MAY_IMPORT]
    assert bad == []


# ------------------------------------------------------------------ import circles and private names

def _module_name(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    return ".".join(("specpilot",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package modules it imports (module-level and lazy imports inside functions alike).
    `from specpilot.a import b` points at module specpilot.a.b when that is one, else at specpilot.a; the package
    `__init__`s Python runs on the way are not counted (re-exports would make every package a circle)."""
    graph: dict[str, set[str]] = {}
    for name, text in sources.items():
        edges = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in sources else node.module
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in sources:  # `import specpilot.a.b.c` as far as it names a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import path a -> ... -> a per circle (a circle found from several of its modules is listed once)."""
    cycles, seen = [], set()
    for start in sorted(graph):
        parent, stack = {start: None}, [start]
        while stack:
            node = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    path = [node]
                    while parent[path[-1]] is not None:  # back along the search tree to start
                        path.append(parent[path[-1]])
                    path = path[::-1] + [start]
                    if frozenset(path) not in seen:
                        seen.add(frozenset(path))
                        cycles.append(path)
                    stack = []
                    break
                if nxt not in parent:
                    parent[nxt] = node
                    stack.append(nxt)
    return cycles


def private_imports(sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """(module, imported-from module, name) for every `from specpilot.x import _name` of another module."""
    bad = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specpilot") \
                    and node.module != name:
                bad += [(name, node.module, alias.name) for alias in node.names
                        if alias.name.startswith("_") and not alias.name.startswith("__")
                        and f"{node.module}.{alias.name}" not in sources]
    return bad


def _package_sources() -> dict[str, str]:
    return {_module_name(rel): (ROOT / rel).read_text() for rel in package_files()}


def test_no_import_circles():
    assert import_cycles(import_graph(_package_sources())) == []


def test_no_private_names_across_modules():
    assert private_imports(_package_sources()) == []


SYNTHETIC = {
    "specpilot.a": "from specpilot.b import f\n",
    "specpilot.b": "import os\n\ndef f():\n    from specpilot.c import g\n    return g\n",
    "specpilot.c": "from specpilot import a\n",
    "specpilot.d": "import specpilot.c\nfrom specpilot.b import _private, f\n",
}


def test_the_circle_checker_sees_a_lazy_circle():
    """The checkers themselves can fail: a circle closed by an import inside a function is found, once, and a
    private name imported from another module is reported."""
    graph = import_graph(SYNTHETIC)
    assert graph == {"specpilot.a": {"specpilot.b"}, "specpilot.b": {"specpilot.c"}, "specpilot.c": {"specpilot.a"},
                     "specpilot.d": {"specpilot.b", "specpilot.c"}}
    assert import_cycles(graph) == [["specpilot.a", "specpilot.b", "specpilot.c", "specpilot.a"]]
    graph["specpilot.c"] = set()
    assert import_cycles(graph) == []
    assert private_imports(SYNTHETIC) == [("specpilot.d", "specpilot.b", "_private")]


# ------------------------------------------------------------------ train/ by concern

# Inside train/, folders import only lower folders (or themselves): the model builders need nothing of the rest,
# Ray plumbing needs no RL, the RL stages may run on Ray, grid search and export use the RL validation / PPO files.
TRAIN_FOLDERS = {"models": 0, "scale": 1, "rl": 2, "grid": 3, "export": 3}
TRAIN_LOOSE = {"__init__.py", "cli.py", "cli_args.py"}  # the `specpilot train` CLI and the torch-free options


def _train_folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["specpilot", "train"] else None


def train_folder_violations(sources: dict[str, str]) -> list[tuple[str, str]]:
    bad = []
    for name, edges in import_graph(sources).items():
        own = _train_folder(name)
        if own is None:
            continue
        for target in edges:
            other = _train_folder(target)
            if other is not None and other != own and TRAIN_FOLDERS[other] >= TRAIN_FOLDERS[own]:
                bad.append((name, target))
            elif other is None and target.startswith("specpilot.train.") and target.rpartition(".")[2] != "cli_args":
                bad.append((name, target))  # a folder module reaching the CLI layer
    return sorted(bad)


def test_train_is_split_into_folders_by_concern():
    loose = sorted(p.name for p in (ROOT / "train").glob("*.py") if p.name not in TRAIN_LOOSE)
    assert loose == [], "train/ modules belong in a folder that says what they are"
    assert {p.name for p in (ROOT / "train").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(TRAIN_FOLDERS)


def test_train_folders_import_only_lower_folders():
    assert train_folder_violations(_package_sources()) == []


def test_the_train_folder_checker_sees_a_violation():
    sources = {"specpilot.train.models.a": "from specpilot.train.rl.b import f\n",
               "specpilot.train.rl.b": "def f():\n    from specpilot.train.models.a import g\n",
               "specpilot.train.grid.c": "from specpilot.train.export.d import h\n",
               "specpilot.train.export.d": "import specpilot.train.cli\n",
               "specpilot.train.cli": ""}
    assert train_folder_violations(sources) == [("specpilot.train.export.d", "specpilot.train.cli"),
                                                ("specpilot.train.grid.c", "specpilot.train.export.d"),
                                                ("specpilot.train.models.a", "specpilot.train.rl.b")]
