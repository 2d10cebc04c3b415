"""The layout's rules, checked on the source: one-way dependencies, no import cycle, small files."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "turnrl"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The turnrl module an import names (``turnrl.a.b.C`` → ``turnrl.a.b`` when that is a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """Every turnrl module ``module`` imports, at any level (lazy imports inside functions too)."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("turnrl"):
                target = _resolve(name)
                if target and target != module:
                    found.add(target)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "turnrl"


# What each low layer may import (besides itself). Everything else composes these.
ALLOWED = {
    "types": set(),
    "bounded": set(),
    "terminal": set(),
    "tasks": {"types", "bounded"},
    "rundir": {"types"},
    "records": {"types", "bounded", "rundir"},
    "chat": {"types"},
    "losses": set(),
    "credit": {"types"},
    "sandbox": set(),
    "envs": {"types", "tasks", "sandbox", "rundir", "sections", "bounded"},
    "sampling": {"types", "chat", "models"},
    "rollout": {"types", "chat", "credit", "envs", "sampling"},
    "models": {"config", "losses", "rundir", "adapterfile"},
    "adapterfile": {"bounded", "sections"},
    "config": {"losses", "sections", "bounded", "configfile"},
    "configfile": {"sections", "bounded"},
    "sections": {"bounded"},
    "audit": {
        "types",
        "chat",
        "credit",
        "envs",
        "rollout",
        "sampling",
        "tasks",
        "eval",
        "config",
        "models",
        "bounded",
        "sections",
        "train",
        "records",
    },
}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_low_layers_import_only_below_them(layer):
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _layer(m) == layer
        for t in targets
        if _layer(t) != layer and _layer(t) not in ALLOWED[layer]
    )
    assert not bad, bad


def test_no_import_cycle_between_modules():
    """Depth-first search for a cycle in the module graph (lazy imports count)."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, cycles[:3]


def test_no_source_file_over_the_limit():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_a_plugin_kind_is_found_without_hasattr():
    """Environment hooks are declared on Env (no hasattr/sys.modules probing in the core)."""
    core = [SRC / "rollout" / "collect.py", SRC / "eval.py", SRC / "envs" / "__init__.py", SRC / "train" / "loop.py"]
    for path in core:
        text = path.read_text()
        assert "hasattr(" not in text and "sys.modules" not in text, path


# The run object and what drives it: the only code that reads the whole run config. Every stage below it
# takes its own settings (a frozen type with a ``from_config`` that reads only its keys).
RUN_LEVEL = {
    "turnrl.config",
    "turnrl.cli",
    "turnrl.export",
    "turnrl.train.settings",
    "turnrl.train.run",
    "turnrl.train.loop",
    "turnrl.train.standalone",
}
RUN_LEVEL_PREFIXES = ("turnrl.experiments", "turnrl.audit")
ENTRY_POINTS = {
    ("turnrl.train.checkpoint", "check_resume_config"),  # the run's resume check, called by Run.prepare
}


def _signatures():
    """(module, function, parameter, annotation source or None) of every function in the package."""
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    yield module, node.name, arg.arg, ast.unparse(arg.annotation) if arg.annotation else None


def test_no_stage_takes_its_settings_as_any():
    """A function's settings are typed: no ``cfg: Any`` (nor an untyped ``cfg``/``settings``)."""
    names = {"cfg", "config", "settings", "section", "plan"}
    bad = sorted(
        f"{m}.{fn}({arg}: {ann})" for m, fn, arg, ann in _signatures() if arg in names and ann in (None, "Any")
    )
    assert not bad, bad


def test_only_the_run_object_takes_the_run_config():
    """Below the run object no signature takes ``RunConfig``; a settings type's ``from_config`` may."""
    bad = sorted(
        f"{m}.{fn}({arg}: {ann})"
        for m, fn, arg, ann in _signatures()
        if ann is not None and "RunConfig" in ann
        if m not in RUN_LEVEL and not m.startswith(RUN_LEVEL_PREFIXES)
        if fn != "from_config" and (m, fn) not in ENTRY_POINTS
    )
    assert not bad, bad


def test_the_checks_above_can_fail():
    """The two signature checks see a ``cfg: Any`` and a ``RunConfig`` parameter where they are."""
    found = {(m, fn) for m, fn, arg, ann in _signatures() if ann is not None and "RunConfig" in ann}
    assert ("turnrl.train.step", "from_config") in found and ("turnrl.train.standalone", "run_eval") in found


# ---- one resolution point: every command builds its run through RunSettings.from_config ----------------

COMMANDS = {
    "turnrl.train.run",  # `turnrl train` (the run object)
    "turnrl.train.standalone",  # `turnrl eval`, and the policy `turnrl credit-audit` audits
    "turnrl.audit.run",  # `turnrl credit-audit`
    "turnrl.experiments.runner",  # `turnrl experiment`
}


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


@functools.cache
def _settings_types() -> frozenset[str]:
    """Classes of the package with a ``from_config`` classmethod (settings types, and samplers' factories)."""
    found = set()
    for module in MODULES:
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.ClassDef):
                if any(isinstance(f, ast.FunctionDef) and f.name == "from_config" for f in node.body):
                    found.add(node.name)
    return frozenset(found)


def _resolutions(tree: ast.AST) -> list[tuple[str, str]]:
    """(enclosing function, ``Class``) of every ``Class.from_config(...)`` call of a settings type."""
    types = _settings_types()
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_config":
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in types:
                out.append((function, owner.id))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return out


def test_every_command_builds_its_run_through_the_one_resolution_point():
    """Each command resolves its config with ``RunSettings.from_config``; no other code resolves a stage's
    settings from a config (a settings type's own ``from_config`` may compose its parts' settings)."""
    for module in sorted(COMMANDS):
        calls = _resolutions(_tree(module))
        assert any(cls == "RunSettings" for _, cls in calls), f"{module} does not call RunSettings.from_config"
    bad = sorted(
        f"{m}.{fn}: {cls}.from_config"
        for m in MODULES
        for fn, cls in _resolutions(_tree(m))
        if cls != "RunSettings" and fn != "from_config"
    )
    assert not bad, bad


def test_the_resolution_check_can_fail():
    """The check sees a second resolution path where one is written."""
    second = "def run_eval(cfg):\n    return EvalSettings.from_config(cfg)\n"
    assert _resolutions(ast.parse(second)) == [("run_eval", "EvalSettings")]
    assert {"RunSettings", "EvalSettings", "RolloutSettings", "LossPlan", "TaskSource"} <= _settings_types()


def test_chats_are_rendered_through_the_runs_chat_settings():
    """``ChatTemplate`` is built in one place outside chat.py: ``ChatSettings.template`` (so every command
    renders a run's chats with the same template arguments and ``model.exclude_think``)."""
    bad = sorted(
        m
        for m in MODULES
        if m != "turnrl.chat"
        for node in ast.walk(_tree(m))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ChatTemplate"
    )
    assert not bad, bad


@pytest.mark.parametrize(
    "module", ["turnrl.models", "turnrl.config", "turnrl.sampling.hf", "turnrl.tracking", "turnrl.cli"]
)
def test_module_imports_first_in_a_fresh_interpreter(module):
    """Registries are imported by name when a config section is built (config → sampling/credit/envs),
    which the source graph above cannot see: a module that is imported first must not meet a cycle."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
