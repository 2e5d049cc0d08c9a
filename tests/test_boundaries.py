"""The layering a newcomer can rely on (docs/design.md), checked on the source:

    common/      the runtime, protocol, models, runner: imports no other layer of Tandem
    services/X/  one service: common/ and its own package, never another service, the SDK or bench
    tandem/      the SDK and CLI            api/   the HTTP gateway (over the SDK)
    bench/       benchmarks and tooling: may use every layer

and no import cycle among Tandem's modules, deferred imports (inside functions) included.
Imports under `if TYPE_CHECKING:` are annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "services", "tandem", "bench", "api")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Modules of Tandem imported anywhere in `tree` (but under `if TYPE_CHECKING:`)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against this module's package
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)   # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in out if m.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = _imports(ast.parse(path.read_text(), str(path)), name,
                        path.name == "__init__.py")
        # an import of `a.b.c` where c is a name, not a module, depends on module a.b
        resolved = set()
        for d in deps:
            while d and d not in modules:
                d = d.rpartition(".")[0]
            if d and d != name:
                resolved.add(d)
        graph[name] = resolved
    return graph


GRAPH = _graph()


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return f"services.{parts[1]}"
    return parts[0]


def test_the_graph_sees_every_package():
    """The checks below are only as good as the graph: it must hold every layer and real
    edges (the dispatcher imports common.runtime)."""
    assert {_layer(m) for m in GRAPH} >= {"common", "tandem", "bench", "api",
                                          "services.dispatcher", "services.verifier"}
    assert "common.runtime" in GRAPH["services.dispatcher.service"]


def test_common_imports_no_higher_layer():
    bad = sorted((m, d) for m, deps in GRAPH.items() if _layer(m) == "common"
                 for d in deps if _layer(d) != "common")
    assert not bad, f"common/ imports a higher layer: {bad}"


def test_no_service_imports_another_service_or_a_client():
    bad = sorted((m, d) for m, deps in GRAPH.items() if _layer(m).startswith("services.")
                 for d in deps if _layer(d) not in ("common", _layer(m)))
    assert not bad, f"a service imports another service, the SDK, the gateway or bench: {bad}"


def test_the_sdk_and_gateway_do_not_import_services_or_bench():
    bad = sorted((m, d) for m, deps in GRAPH.items() if _layer(m) in ("tandem", "api")
                 for d in deps if _layer(d) == "bench"
                 or (_layer(d).startswith("services.") and _layer(m) == "api"))
    assert not bad, bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    # a package's __init__ importing its own submodules is not a cycle worth reporting
    graph = {m: {d for d in deps if not (m.startswith(d + ".") and
                                         (ROOT / d.replace(".", "/") / "__init__.py").exists())}
             for m, deps in GRAPH.items()}
    cycles = [c for c in _cycles(graph) if any(_layer(m).split(".")[0] == package for m in c)]
    assert not cycles, f"import cycles: {cycles}"
