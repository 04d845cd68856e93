"""Architecture rules that keep the decision core free of the runtime."""

import ast
from pathlib import Path

import planner

PACKAGE = Path(planner.__file__).parent


def _imported_modules(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_planner_never_imports_torch_distributed():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in _imported_modules(path) if name.startswith("torch.distributed")
        )
        for path in PACKAGE.rglob("*.py")
    }
    assert {file: names for file, names in offenders.items() if names} == {}


def test_the_runtime_is_reached_only_through_a_call():
    imports = _imported_modules(PACKAGE / "__init__.py", top_level_only=True)
    assert not any(name.startswith("strategies") for name in imports)
