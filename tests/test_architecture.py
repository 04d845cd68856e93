"""The house rules: imports run one way, the decision core loads no torch.

Layers, lowest first; a module may import its own layer and those below it, never one
above. Every import counts (top level, inside functions, ``importlib.import_module``
strings and the lazy-attribute maps of package ``__init__`` files) except those under
``if TYPE_CHECKING:``, which never run. Only the doors (the CLI and
``planner.parallelize``) reach the runtime (``strategies``).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import planner

PACKAGE = Path(planner.__file__).parent
ROOT = PACKAGE.parent

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("planner.errors", "planner.dtypes", "planner.fqn", "planner.lazy",
                    "planner.io", "planner.version")),
    ("documents", ("planner.spec", "planner.graph", "planner.presets", "planner.parallel_dims",
                   "planner.hardware", "planner.clusters", "planner.measured",
                   "planner.frameworks")),
    ("cost", ("planner.cost",)),
    ("decisions", ("planner.solve", "planner.validate", "planner.export", "planner.compare",
                   "planner.plots", "planner.scale_math", "planner.importers",
                   "planner.calibrate.fit",
                   "planner.calibrate.options",
                   "planner.calibrate.profile", "planner.calibrate.links",
                   "planner.calibrate.nccl_tests")),
    ("torch", ("planner.models", "planner.hf", "planner.tracing", "planner.modules", "planner.staging",
               "planner.rehearse", "planner.layouts", "planner.assemble", "planner.planning",
               "planner.scaling", "planner.priced_plan", "planner.calibrate.refit",
               "planner.calibrate.microbench", "planner.calibrate", "planner.torch_dtypes")),
    ("doors", ("planner.cli", "planner.__main__", "planner", "strategies")),
)  # fmt: skip
TORCH_FREE = ("foundation", "documents", "cost", "decisions")
# Modules that import a name only known at run time: the user's model path, and the
# lazy-attribute helper (whose targets are checked through each package's _LAZY map).
DYNAMIC_IMPORTERS = {"planner.models": "the user's module:function", "planner.lazy": "_LAZY"}


def layer_of(module: str) -> int | None:
    """Index of ``module``'s layer (the longest listed prefix wins); None outside planner."""
    best, rank = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    return rank


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str) -> tuple[set[str], list[str]]:
    """(modules the source imports when it runs, dynamic imports it cannot name)."""
    tree = ast.parse(source)
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for child in ast.walk(stmt)
    }
    names: set[str] = set()
    dynamic: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            argument = node.args[0] if node.args else None
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                names.add(argument.value)
            else:
                dynamic.append(ast.unparse(node))
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
        ):
            assert isinstance(node.value, ast.Dict)
            names.update(v.value for v in node.value.values if isinstance(v, ast.Constant))
    return names, dynamic


def violations(module: str, source: str) -> list[str]:
    """Each import of ``module`` that runs up a layer, into the runtime or into torch."""
    own = layer_of(module)
    assert own is not None, f"{module} is in no layer: add it to LAYERS"
    names, dynamic = imports_of(source)
    found = [
        f"{module} imports by a computed name: {call}"
        for call in dynamic
        if module not in DYNAMIC_IMPORTERS
    ]
    for name in sorted(names):
        target = layer_of(name)
        if name.split(".")[0] == "torch" and LAYERS[own][0] in TORCH_FREE:
            found.append(f"{module} ({LAYERS[own][0]}) imports {name}")
        elif name.split(".")[0] == "strategies" and LAYERS[own][0] != "doors":
            found.append(f"{module} ({LAYERS[own][0]}) imports the runtime: {name}")
        elif name.startswith("planner") and target is not None and target > own:
            found.append(f"{module} ({LAYERS[own][0]}) imports {name} ({LAYERS[target][0]})")
    return found


def test_imports_run_one_way():
    found = [
        problem
        for path in sorted(PACKAGE.rglob("*.py"))
        for problem in violations(module_name(path), path.read_text())
    ]
    assert found == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("planner.cost.model", "from planner.tracing import trace", "imports planner.tracing"),
        ("planner.cost.model", "def f():\n    import strategies.runner", "imports the runtime"),
        ("planner.solve.search", "import importlib\nimportlib.import_module('strategies.x')",
         "imports the runtime"),
        ("planner.spec", "import importlib\nimportlib.import_module(name)", "computed name"),
        ("planner.validate", "import torch", "imports torch"),
        ("planner.export", "_LAZY = {'x': 'planner.planning'}", "imports planner.planning"),
    ],
)  # fmt: skip
def test_the_layering_check_catches_an_import_up(module, source, expected):
    assert any(expected in problem for problem in violations(module, source))


def test_type_checking_imports_do_not_count():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    assert violations("planner.spec", source) == []


def test_planner_never_imports_torch_distributed():
    offenders = {
        module_name(path): sorted(
            name for name in imports_of(path.read_text())[0] if name.startswith("torch.distributed")
        )
        for path in PACKAGE.rglob("*.py")
    }
    assert {module: names for module, names in offenders.items() if names} == {}


def test_the_decision_core_loads_no_torch():
    """Real imports, in a fresh interpreter: the torch-free layers and the CLI's parser."""
    modules = sorted(
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if LAYERS[layer_of(module_name(path)) or 0][0] in TORCH_FREE
    )
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "import planner.cli\nplanner.cli.build_parser()\n"
        + "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'strategies')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("package", ["planner", "planner.calibrate"])
def test_no_lazy_name_is_also_a_submodule(package):
    """Importing a submodule binds its name on the package, hiding a lazy attribute of
    the same name (``planner.make_plan`` would become a module, not the function)."""
    module = importlib.import_module(package)
    folder = Path(module.__file__).parent
    submodules = {p.stem for p in folder.glob("*.py")} | {
        p.name for p in folder.iterdir() if p.is_dir()
    }
    assert set(module._LAZY) & submodules == set()


def test_public_submodules_load_on_first_use():
    """``import planner`` then ``planner.export`` / ``planner.plots`` work, as the README
    writes them, without importing torch."""
    code = (
        "import sys, planner\n"
        "print(callable(planner.export.export_plan), callable(planner.plots.plot_plan),"
        " callable(planner.frameworks.parse_target), 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.split() == ["True", "True", "True", "False"]


@pytest.mark.slow  # a fresh interpreter imports every module, torch too
def test_lazy_names_survive_importing_every_submodule():
    code = (
        "import pkgutil, importlib, planner\n"
        "for m in pkgutil.walk_packages(planner.__path__, 'planner.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print(callable(planner.make_plan), callable(planner.trace))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.split() == ["True", "True"]
