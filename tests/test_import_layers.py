"""pagecli's packages import downward only, and no module imports itself back through others.

Every import counts: at module level, inside functions (imported later, but a dependency all the
same) and under `if TYPE_CHECKING:`. `from package import name` is an import of the submodule
`package.name` where one exists, else of the package. A module importing its own packages (their
`__init__`, which Python runs first anyway) is not an edge. docs/ARCHITECTURE.md explains the layers.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pagecli
import pagecli.kernels

# Lowest first. A module belongs to the longest prefix listed; it may import its own layer's modules
# and any layer listed before it, never one after it.
LAYERS = [
    ("pagecli", "pagecli.errors", "pagecli.paths"),  # shared definitions, no torch
    ("pagecli.config",),  # settings and profiles, no torch
    ("pagecli.kv_format",),  # the KV cache's formats: the Triton kernels, the C++ kernels' callers, the store
    ("pagecli.native",),  # the compiled CPU kernels and their loader
    ("pagecli.kernels",),  # the Triton kernels
    ("pagecli.attention",),  # attention backends over the KV pool
    ("pagecli.models",),  # model folders, GGUF files, the decoder, weight forms
    ("pagecli.store",),  # the disk prefix store
    ("pagecli.engine",),  # block pool, scheduler, sampler, the Engine
    ("pagecli.batch",),  # batch input and results files
    ("pagecli.chat",),  # the chat loop without a screen
    ("pagecli.bench",),  # benchmarks and reports
    ("pagecli.ui",),  # Rich views
    ("pagecli.serve",),  # the HTTP server
    ("pagecli.cluster",),  # Ray workers and driver
    ("pagecli.doctor",),
    # the commands: the CLI, and the `python -m` entry points of lower packages, which report on the whole
    ("pagecli.cli", "pagecli.__main__", "pagecli.native.__main__", "pagecli.attention.aot",
     "pagecli.attention.aot_lora"),
]


def _modules() -> dict[str, Path]:
    """Every module of the installed package (pagecli.kernels lives in the repository's kernels/)."""
    found = {}
    for package, root in (("pagecli", Path(pagecli.__file__).parent), ("pagecli.kernels", Path(pagecli.kernels.__file__).parent)):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for target in targets:
                if target in modules and target != name and target not in own_packages:
                    graph[name].add(target)
    return graph


def layer_of(module: str) -> int:
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank is not None, f"{module} is in no layer: add it to LAYERS (and to docs/ARCHITECTURE.md)"
    return rank


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back():
    graph = import_graph()
    loops = cycles(graph)
    described = ["; ".join(f"{a} -> {b}" for a in loop for b in sorted(graph[a]) if b in loop) for loop in loops]
    assert not loops, "import loops:\n" + "\n".join(described)


def test_every_import_goes_down_the_layers():
    upward = sorted(f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
                    if layer_of(b) > layer_of(a))
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_checker_sees_a_loop_and_an_upward_import():
    graph = {"pagecli.a": {"pagecli.b"}, "pagecli.b": {"pagecli.c"}, "pagecli.c": {"pagecli.a"}, "pagecli.d": set()}
    assert cycles(graph) == [["pagecli.a", "pagecli.b", "pagecli.c"]]
    assert layer_of("pagecli.engine.sampler") > layer_of("pagecli.models.decoder") > layer_of("pagecli.native")
    assert layer_of("pagecli.kv_format") < layer_of("pagecli.kernels.common")
