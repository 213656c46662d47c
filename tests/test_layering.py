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
    ("train/grid.py", "specpilot.eval.runner", False),
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
