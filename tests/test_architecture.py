"""The package's shape: no import cycle, layers below models, the training stack pointing
down, short functions.

The training stack, from the bottom: ``losses``; ``train/`` (config, optimizer, step and
its compile, checkpoints, resuming, the loop; it takes a task as a value); ``tasks/``
(which may read ``train/``: a finished run's parameters, the config); ``run``,
``workdir`` and the other modules that wire a task into the loop or read a run back
(``export``, ``compare_torch``, ``sweep``, ``aot``); ``cli`` on top. Each imports only
from below it.

Read from the source with ``ast`` (nothing is imported): every import between
transformer_jax modules, at module level or inside a function (a late import is still a
dependency), except those under ``if TYPE_CHECKING:``.
"""
import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer_jax"
MAX_FUNCTION_LINES = 80           # body lines, the docstring not counted
LONG_REASON = "# Long because"    # a function that must be longer says why, in a comment


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports(name: str, path: Path) -> set[str]:
    """The transformer_jax modules ``name`` imports (``from .x import y`` where y is a
    module counts as importing y)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found |= set(subs) if len(subs) == len(node.names) else {target, *subs}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in MODULES and m != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports; parsed on first use, not at collection (each
    pytest-xdist worker collects every test module)."""
    return {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_read_from_the_source():
    assert len(MODULES) > 40
    assert "transformer_jax.layers.attention_base" in graph()["transformer_jax.layers.attention"]
    assert "transformer_jax.models.t5" in graph()["transformer_jax.interop.hf.t5"]


def test_no_import_cycle():
    assert _cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]


def _under(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


def test_layers_and_models_depend_downward_only():
    """layers imports nothing of the package but layers (and errors); models only layers."""
    for module in _under("transformer_jax.layers"):
        for dep in graph()[module]:
            assert dep.startswith("transformer_jax.layers") or dep == "transformer_jax.errors", \
                (module, dep)
    for module in _under("transformer_jax.models"):
        for dep in graph()[module]:
            assert dep.startswith(("transformer_jax.layers", "transformer_jax.models",
                                   "transformer_jax.errors")), (module, dep)


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph()[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


# the modules above ``tasks/`` that wire a task into the loop, or read a finished run back
WIRING = ("transformer_jax.run", "transformer_jax.workdir", "transformer_jax.export",
          "transformer_jax.compare_torch", "transformer_jax.sweep", "transformer_jax.aot")


def test_the_training_stack_depends_downward_only():
    """train -> tasks -> run/workdir -> cli. Nothing in ``train/`` imports ``tasks/`` (no
    exception), nor a wiring module; tasks read a finished run through
    ``train/checkpoint.py`` and never reach the loop or the wiring; nothing imports the
    CLI; ``losses`` needs only ``errors``."""
    assert "transformer_jax.train.checkpoint" in graph()["transformer_jax.tasks.classify"]
    assert "transformer_jax.tasks" in graph()["transformer_jax.run"]
    for name in _under("transformer_jax.train"):
        assert not any(d.startswith("transformer_jax.tasks") for d in graph()[name]), name
        assert not _reachable(name) & (set(_under("transformer_jax.tasks")) | set(WIRING)), name
    for name in _under("transformer_jax.tasks"):
        up = {d for d in graph()[name] if d.startswith("transformer_jax.train")}
        assert up <= {"transformer_jax.train.checkpoint"}, (name, up)
        assert not _reachable(name) & set(WIRING), name
    assert not any("transformer_jax.cli" in deps for deps in graph().values())
    assert graph()["transformer_jax.losses"] <= {"transformer_jax.errors"}
    above = set(_under("transformer_jax.tasks")) | set(_under("transformer_jax.models")) | {
        "transformer_jax.train.loop", "transformer_jax.cli", *WIRING}
    assert not _reachable("transformer_jax.train.checkpoint") & above


def _long_functions() -> list[str]:
    out = []
    for name, path in MODULES.items():
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and len(body) > 1:
                body = body[1:]                                      # the docstring
            lines = source[body[0].lineno - 1: node.end_lineno]
            if len(lines) > MAX_FUNCTION_LINES and not any(LONG_REASON in ln for ln in lines):
                out.append(f"{name}.{node.name} ({len(lines)} lines)")
    return out


def test_functions_are_short_or_say_why():
    assert _long_functions() == []


def _private_imports(name: str, path: Path) -> list[str]:
    """``from <another transformer_jax module> import _name`` in module ``name``: a private
    name used across modules (a module named with ``_`` is not a private name)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target.split(".")[0] != "transformer_jax" or target == name:
            continue
        out += [f"{name}: from {target} import {a.name}" for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
                and f"{target}.{a.name}" not in MODULES]
    return out


def test_no_module_imports_another_modules_private_name():
    found = [line for name, path in MODULES.items() for line in _private_imports(name, path)]
    assert found == []


def test_the_private_import_finder_finds_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from .pipeline import _read, open_source\nfrom . import stdlib_corpus\n")
    assert _private_imports("transformer_jax.data.m", path) == [
        "transformer_jax.data.m: from transformer_jax.data.pipeline import _read"]


MAX_MODULE_LINES = 600
LONG_MODULE_REASON = "# Over 600 lines because"   # in the comment lines a module opens with


def _opening_comment(text: str) -> str:
    lines = text.splitlines()
    return "\n".join(ln for ln in lines[:next((i for i, ln in enumerate(lines)
                                                if not ln.startswith("#")), len(lines))])


def test_modules_are_at_most_600_lines_or_say_why():
    """A module over 600 lines opens with a comment saying why (one job that reads best
    whole); every other module is split before it gets there."""
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()
            if len(path.read_text().splitlines()) > MAX_MODULE_LINES
            and LONG_MODULE_REASON not in _opening_comment(path.read_text())}
    assert not long, f"modules over {MAX_MODULE_LINES} lines with no '{LONG_MODULE_REASON}' comment: {long}"


def test_the_opening_comment_is_the_comment_lines_before_the_code():
    assert _opening_comment("# a\n# b\n'''doc'''\n# c\n") == "# a\n# b"
    assert _opening_comment('"""doc"""\n# Over 600 lines because x\n') == ""
