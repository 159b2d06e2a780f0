"""The package's layers: a module imports only from its own layer or the ones below, and
no two modules import each other (directly or round a longer cycle)."""
from __future__ import annotations

import ast
from pathlib import Path

import batchinfer

PACKAGE = Path(batchinfer.__file__).parent
# lowest first; a module's layer is that of the longest prefix listed
LAYERS = [
    ["batchinfer.config", "batchinfer.outputs", "batchinfer.sampling_params",
     "batchinfer.paths", "batchinfer.flags", "batchinfer.structured", "batchinfer.data",
     "batchinfer.reasoning", "batchinfer.tool_parsers"],
    ["batchinfer.kernels"],
    ["batchinfer.model", "batchinfer.attention"],
    ["batchinfer.engine"],
    ["batchinfer.llm", "batchinfer.demo", "batchinfer.random_checkpoint"],
    ["batchinfer.job", "batchinfer.bench"],
    ["batchinfer.cli", "batchinfer.__main__", "batchinfer"],
]


def layer_of(module: str) -> int:
    best, rank = "", None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, rank = name, i
    assert rank is not None, f"{module} is in no layer"
    return rank


def modules() -> dict[str, Path]:
    import batchinfer.kernels
    found = {}
    roots = [(PACKAGE, "batchinfer"), (Path(batchinfer.kernels.__file__).parent,
                                       "batchinfer.kernels")]
    for root, prefix in roots:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((prefix, *parts))
            if prefix == "batchinfer" and parts[:1] == ("kernels",):
                continue
            found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules this one imports, at any depth of its code."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_module_imports_from_a_higher_layer():
    found = modules()
    known = set(found)
    wrong = []
    for name, path in sorted(found.items()):
        for target in sorted(imports(name, path, known)):
            if layer_of(target) > layer_of(name) and not name.startswith(target + "."):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports from a higher layer:\n" + "\n".join(wrong)


def test_no_import_cycles():
    found = modules()
    known = set(found)
    graph = {name: {t for t in imports(name, path, known)
                    if not name.startswith(t + ".")}  # a package's own __init__
             for name, path in found.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
