"""The house's floors, from its imports: cluster/ (the CLI, the app, the bench) on top, then
router/, then replicas/ (the pools, the engines and what both the router and the engines
use, such as lookup drafting and the tokenizer) at the bottom; training/ beside them. A
floor imports only from itself and below, and from above only the config schema,
cluster/config.py, a leaf (it imports no project module)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "router", "replicas", "training")
BELOW = {"replicas": set(), "router": {"replicas"}, "training": {"replicas"},
         "cluster": {"router", "replicas", "training"}}
LEAF = "cluster.config"


def project_imports(path: Path) -> set[str]:
    """The project modules a file imports (every import statement, functions' included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def upward_imports(root: Path = ROOT) -> list[str]:
    wrong = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for name in sorted(project_imports(path)):
                floor = name.split(".")[0]
                if floor == package or floor in BELOW[package] or name == LEAF:
                    continue
                wrong.append(f"{path.relative_to(root)} imports {name}")
    return wrong


def test_no_floor_imports_from_a_floor_above_but_the_config_schema():
    assert upward_imports() == []


def test_the_config_schema_is_a_leaf():
    assert project_imports(ROOT / "cluster" / "config.py") == set()


def test_the_check_sees_an_import_put_back(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "replicas" / "engine.py").write_text("def f():\n    from router.lookup import lookup_match\n")
    (tmp_path / "router" / "ingress.py").write_text("from cluster.config import ClusterConfig\nimport replicas.engine\n")
    assert upward_imports(tmp_path) == ["replicas/engine.py imports router.lookup"]
