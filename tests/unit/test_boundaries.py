"""The layering a newcomer can rely on (docs/design.md), checked on the source:

    stack/       deployment: the CLI, launcher, in-process stack, WAN emulator, observability,
                 key files, the plan with each service's settings: may import every layer
    bench/       benchmarks and tooling: may use every layer
    api/         the HTTP gateway: common/ and the SDK (tandem/), never a service or the stack
    tandem/      the SDK: common/ only
    services/X/  one service: common/ and its own package, never another service
    common/      the runtime, protocol, models, runner: imports no other layer of Tandem

and no import cycle among Tandem's modules, deferred imports (inside functions) included.
Imports under `if TYPE_CHECKING:` are annotations only and do not count.

A module reached without an import statement counts as imported too: the target of
`importlib.import_module(...)` / `__import__(...)`, and the module after "-m" in an argument
list (`[sys.executable, "-m", "services.verifier.service", ...]`).  Such a target may be a
string, an f-string or a `+` of strings (`f"services.{role}.service"`: a placeholder stands for
one dotted name and the target is every module it matches), a literal dict indexed by a key (each
value), or a local name assigned one of those.  A target built any other way is not seen.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "services", "tandem", "bench", "api", "stack")
WILD = "*"   # in a dynamic target: one dotted name only known at run time


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _assignments(tree: ast.AST) -> dict[ast.AST, dict[str, list[ast.expr]]]:
    """For each function (and the module): the values assigned to each plain local name."""
    scopes: dict[ast.AST, dict[str, list[ast.expr]]] = {}
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            names: dict[str, list[ast.expr]] = {}
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            names.setdefault(t.id, []).append(node.value)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                        and node.value is not None:
                    names.setdefault(node.target.id, []).append(node.value)
            scopes[scope] = names
    return scopes


def _targets(node: ast.expr, names: dict[str, list[ast.expr]], depth: int = 0) -> set[str]:
    """The module names an expression can hold, WILD where a part is only known at run time;
    empty where it cannot be told from the source."""
    if depth > 4:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.JoinedStr):
        return {"".join(v.value if isinstance(v, ast.Constant) else WILD for v in node.values)}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _targets(node.left, names, depth + 1) or {WILD}
        right = _targets(node.right, names, depth + 1) or {WILD}
        return {a + b for a in left for b in right}
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
        return {t for v in node.value.values for t in _targets(v, names, depth + 1)}
    if isinstance(node, ast.Name):
        return {t for v in names.get(node.id, ()) for t in _targets(v, names, depth + 1)}
    return set()


def _is_import_call(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
        (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Modules of Tandem imported anywhere in `tree` (but under `if TYPE_CHECKING:`), by an
    import statement, `importlib.import_module` or a "-m" launch; dynamic targets may hold WILD."""
    out: set[str] = set()
    scopes = _assignments(tree)

    def visit(node: ast.AST, names: dict[str, list[ast.expr]]) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, names)
            return
        if node in scopes:
            names = scopes[node]
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
        elif isinstance(node, ast.Call) and _is_import_call(node) and node.args:
            out.update(_targets(node.args[0], names))
        elif isinstance(node, (ast.List, ast.Tuple)):   # [python, "-m", MODULE, ...]
            elts = node.elts
            for i, e in enumerate(elts[:-1]):
                if isinstance(e, ast.Constant) and e.value == "-m":
                    out.update(_targets(elts[i + 1], names))
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    visit(tree, {})
    return {m for m in out if m.split(".")[0] in PACKAGES}


def _resolve(dep: str, modules: dict[str, Path]) -> set[str]:
    """The modules an imported name stands for: `a.b.c` where c is a name, not a module, is
    module a.b; a dynamic target is every module it matches (else its fixed prefix)."""
    if WILD in dep:
        pattern = re.compile("".join("[^.]+" if part == WILD else re.escape(part)
                                     for part in re.split(r"(\*)", dep)))
        matched = {m for m in modules if pattern.fullmatch(m)}
        if matched:
            return matched
        dep = dep.partition(WILD)[0].rstrip(".")
    while dep and dep not in modules:
        dep = dep.rpartition(".")[0]
    return {dep} if dep else set()


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")]
    modules = {_module_name(p, root): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = _imports(ast.parse(path.read_text(), str(path)), name,
                        path.name == "__init__.py")
        graph[name] = {r for d in deps for r in _resolve(d, modules) if r != name}
    return graph


GRAPH = _graph()


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return f"services.{parts[1]}"
    return parts[0]


def _allowed(layer: str) -> set[str] | None:
    """The layers a module of `layer` may import (its own always); None: any."""
    if layer in ("stack", "bench"):
        return None
    if layer.startswith("services."):
        return {"common", layer}
    return {"common": {"common"}, "tandem": {"common", "tandem"},
            "api": {"common", "tandem", "api"}}.get(layer, {layer})


def _violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    out = []
    for m, deps in graph.items():
        allowed = _allowed(_layer(m))
        if allowed is not None:
            out += [(m, d) for d in deps if _layer(d) not in allowed]
    return sorted(out)


def test_the_graph_sees_every_package():
    """The checks below are only as good as the graph: it must hold every layer and real
    edges: an import (the dispatcher imports common.runtime), a "-m" launch built by an
    f-string (the launcher starts every service) and an `importlib.import_module` load (the
    plan loads every service's config)."""
    assert {_layer(m) for m in GRAPH} >= {"common", "tandem", "bench", "api", "stack",
                                          "services.dispatcher", "services.verifier"}
    assert "common.runtime" in GRAPH["services.dispatcher.service"]
    assert {"services.verifier.service", "services.dispatcher.service",
            "api.service"} <= GRAPH["stack.launcher"]
    assert {"services.verifier.config", "services.suffix.config"} <= GRAPH["stack.plan"]
    assert {"stack.wan_cli", "stack.keys", "bench.cli"} <= GRAPH["stack.cli"]


def test_common_imports_no_higher_layer():
    bad = [(m, d) for m, d in _violations(GRAPH) if _layer(m) == "common"]
    assert not bad, f"common/ imports a higher layer: {bad}"


def test_no_service_imports_another_service_or_a_client():
    bad = [(m, d) for m, d in _violations(GRAPH) if _layer(m).startswith("services.")]
    assert not bad, f"a service imports another service, the SDK, the gateway, the stack or bench: {bad}"


def test_the_sdk_imports_common_only():
    bad = [(m, d) for m, d in _violations(GRAPH) if _layer(m) == "tandem"]
    assert not bad, f"the SDK imports more than common/: {bad}"


def test_the_gateway_imports_common_and_the_sdk_only():
    bad = [(m, d) for m, d in _violations(GRAPH) if _layer(m) == "api"]
    assert not bad, f"the gateway imports a service, the stack or bench: {bad}"


def test_the_dispatcher_and_the_sdk_run_without_torch():
    """Edge processes carry no model: the dispatcher and the SDK import no torch (a second and
    ~180 MB each), nor transformers."""
    code = ("import sys, services.dispatcher.service, tandem.client\n"
            "sys.exit(', '.join(m for m in ('torch', 'transformers') if m in sys.modules) or None)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and not r.stderr, f"imported: {r.stderr}"


def test_no_violation_anywhere():
    """The rules above, for every layer at once (a package added to PACKAGES included)."""
    assert not _violations(GRAPH)


PLANTED = {
    "common/__init__.py": "",
    "common/runtime.py": "X = 1\n",
    # an upward "-m" launch: common/ starting the stack's launcher
    "common/spawn.py": """
        import subprocess, sys
        def start(state):
            return subprocess.Popen([sys.executable, "-m", "stack.launcher", "supervise", state])
        """,
    "services/__init__.py": "",
    "services/a/__init__.py": "",
    "services/a/config.py": "",
    "services/b/__init__.py": "",
    "services/b/config.py": "",
    # an importlib load of every service's config from inside one service (reaches services.b)
    "services/a/service.py": """
        import importlib
        from common import runtime
        def settings(name):
            return importlib.import_module(f"services.{name}.config")
        """,
    "tandem/__init__.py": "",
    # the SDK loading the CLI through a local name holding a literal dict's value
    "tandem/client.py": """
        from importlib import import_module
        def run(cmd):
            module = {"up": "stack" + ".cli"}[cmd]
            return import_module(module)
        """,
    # the same under TYPE_CHECKING is an annotation only
    "tandem/typed.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import stack.cli
        """,
    "api/__init__.py": "",
    # the gateway launching a service as a process
    "api/app.py": """
        import sys
        CMD = (sys.executable, "-m", "services.a.service")
        """,
    "stack/__init__.py": "",
    "stack/cli.py": "",
    "stack/launcher.py": """
        import sys
        def args(role):
            return [sys.executable, "-m", f"services.{role}.service"]
        """,
}


def test_planted_dynamic_imports_are_caught(tmp_path):
    for rel, text in PLANTED.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    graph = _graph(tmp_path)
    assert _violations(graph) == [
        ("api.app", "services.a.service"),               # "-m" in a tuple
        ("common.spawn", "stack.launcher"),              # "-m" in a list
        ("services.a.service", "services.b.config"),     # import_module(f"...{name}...")
        ("tandem.client", "stack.cli"),                  # import_module(name), dict + concatenation
    ]
    assert graph["services.a.service"] == {"common", "common.runtime", "services.a.config",
                                          "services.b.config"}
    # the stack may launch any service: "-m" f"services.{role}.service" is every service module
    assert graph["stack.launcher"] == {"services.a.service"}
    assert graph["tandem.typed"] == set()


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
