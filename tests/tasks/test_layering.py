"""The import layering of the training stack: ``losses`` -> ``train`` -> ``tasks`` -> ``cli``.

Read from the source (every ``import`` statement, at module level or inside a function),
not from ``sys.modules``: a late import inside a function counts like any other.
``train/loop.py`` builds the task, so it alone in ``train/`` imports ``tasks``; tasks read a
finished run through ``train/checkpoint.py`` and never reach the loop.
"""
import ast
from pathlib import Path

import pytest

import transformer_jax

ROOT = Path(transformer_jax.__file__).resolve().parent
PACKAGE = "transformer_jax"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """The ``transformer_jax`` modules that ``path`` imports anywhere in its body."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:   # `from pkg import module` imports the module
                sub = f"{target}.{alias.name}"
                out.add(sub if is_module(sub) else target)
    out.discard(me)
    return out


GRAPH = {module_name(p): imports_of(p) for p in ROOT.rglob("*.py")}
STACK = {m for m in GRAPH if m.startswith((f"{PACKAGE}.train", f"{PACKAGE}.tasks"))
         or m in (f"{PACKAGE}.cli", f"{PACKAGE}.losses")}


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_was_read():
    assert f"{PACKAGE}.train.checkpoint" in GRAPH[f"{PACKAGE}.tasks.classify"]
    assert f"{PACKAGE}.tasks" in GRAPH[f"{PACKAGE}.train.loop"]
    assert f"{PACKAGE}.losses" in GRAPH[f"{PACKAGE}.train.step"]
    assert len(STACK) >= 16


@pytest.mark.parametrize("module", sorted(STACK))
def test_no_import_cycle_through_the_training_stack(module):
    assert module not in reachable(module), f"{module} imports itself back"


def test_layers_point_down():
    for name in STACK:
        deps = GRAPH[name]
        if name.startswith(f"{PACKAGE}.tasks"):
            up = {d for d in deps if d.startswith(f"{PACKAGE}.train")} - {f"{PACKAGE}.train.checkpoint"}
            assert not up, f"{name} reaches into the training loop's side: {up}"
        if name.startswith(f"{PACKAGE}.train") and name != f"{PACKAGE}.train.loop":
            assert not {d for d in deps if d.startswith(f"{PACKAGE}.tasks")}, name
        assert f"{PACKAGE}.cli" not in deps, f"{name} imports the CLI"
    assert GRAPH[f"{PACKAGE}.losses"] <= {f"{PACKAGE}.errors"}
    # what tasks read runs through stays below the loop, the tasks and the models
    above = {m for m in GRAPH if m.startswith((f"{PACKAGE}.tasks", f"{PACKAGE}.models"))}
    assert not reachable(f"{PACKAGE}.train.checkpoint") & (above | {f"{PACKAGE}.train.loop",
                                                                   f"{PACKAGE}.cli"})
