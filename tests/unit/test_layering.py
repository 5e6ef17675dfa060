"""The package layering of docs/architecture.md §4: a module imports only packages at or
below its own level (lazy imports inside functions count; ``if TYPE_CHECKING:`` blocks do
not, they are annotations only)."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "attnserve"

#: level of each top-level unit; higher may import lower or equal
LEVEL = {
    "triton_env": 0,
    "triton_jit": 0,
    "env_options": 0,
    "pdl": 0,
    "pdl_triton": 0,
    "mem_cache": 1,
    "forward_batch": 2,
    "attention": 3,
    "server_args": 3.5,
    "sglang_flags": 3.5,
    "speculative_config": 3.5,
    "distributed": 3.7,
    "models": 4,
    "model_loader": 5,
    "engine": 6,
    "server": 7,
    "bench": 8,
    "cli": 9,
    "__main__": 9,
    "__init__": 9,
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno


def test_every_package_imports_only_downwards():
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        own = rel.parts[0][:-3] if len(rel.parts) == 1 else rel.parts[0]
        assert own in LEVEL, f"{rel}: unknown unit {own!r}; add it to LEVEL and docs/architecture.md"
        for module, line in _imports(path):
            if module == "attnserve" or not module.startswith("attnserve."):
                continue
            other = _unit(module)
            if LEVEL[other] > LEVEL[own]:
                bad.append(f"{rel}:{line} imports {module}")
    assert bad == [], "\n".join(bad)


def test_the_checker_sees_upward_imports(tmp_path):
    """The rule can fail: an attention module importing the engine is caught."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from attnserve.engine.engine import Engine\n")
    assert [m for m, _ in _imports(src)] == ["attnserve.engine.engine"]
    assert LEVEL[_unit("attnserve.engine.engine")] > LEVEL["attention"]
