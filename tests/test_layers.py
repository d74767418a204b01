"""The layers, read from the source (an AST walk; nothing here imports the code it checks): pure cores,
the lab apart from the product, no import circles, no imports of another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORES = ("mesh/protocol.py", "mesh/hashing.py", "mesh/kv_events.py", "mesh/index/", "mesh/routing/", "mesh/engine_model.py", "mesh/engine_config.py", "mesh/engine_dp.py",
         "mesh/broker_core/", "mesh/load.py", "mesh/params.py", "mesh/stats.py", "mesh/errors.py", "mesh/namespaces.py",
         "mesh/openai_logprobs.py", "mesh/worker/session.py", "mesh/tenants.py")
SHELL_ONLY = {"zmq", "grpc", "asyncio", "aiohttp", "time", "socket"}
#: file -> (module it may import anyway, why); empty: every core takes `now` (or a clock callable) from its shell
KNOWN: dict[str, tuple[str, str]] = {}
#: (importer, module, name) -> why
KNOWN_PRIVATE: dict[tuple[str, str, str], str] = {}
OURS = ("mesh", "brokers", "workers_stub")

FILES = {p.relative_to(ROOT).as_posix(): p for pkg in ("mesh", "brokers", "workers_stub") for p in (ROOT / pkg).rglob("*.py")}
MODULES = {f.removesuffix(".py").removesuffix("/__init__").replace("/", "."): f for f in FILES}


def _module_of(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(file: str):
    """(imported name, name imported from it or None, inside a function) per import of ``file``."""
    mod = [k for k, v in MODULES.items() if v == file][0]
    pkg = mod if file.endswith("__init__.py") else mod.rpartition(".")[0]

    def walk(node, in_def):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.Import):
                yield from ((a.name, None, in_def) for a in ch.names)
            elif isinstance(ch, ast.ImportFrom):
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - ch.level + 1] + [ch.module or ""]).strip(".") \
                    if ch.level else ch.module
                yield from ((f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, a.name, in_def) for a in ch.names)
            yield from walk(ch, in_def or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return list(walk(ast.parse(FILES[file].read_text()), False))


EDGES = {m: [(_module_of(n), name, in_def) for n, name, in_def in _imports(f)] for m, f in MODULES.items()}


def test_cores_import_no_shell_module():
    bad = [(f, n) for f in FILES if f.startswith(CORES) for n, _, _ in _imports(f)
           if n.split(".")[0] in SHELL_ONLY and KNOWN.get(f, ("",))[0] != n.split(".")[0]]
    assert not bad, f"a core imports a shell's module (take `now` or a callable instead): {bad}"


def test_only_the_cli_loader_imports_the_lab():
    bad = [(m, t) for m, es in EDGES.items() if not m.startswith("mesh.lab") for t, _, in_def in es
           if t and t.startswith("mesh.lab") and not (m == "mesh.cli" and in_def)]
    assert not bad, f"the product imports the lab (only mesh.cli's lazy loader may): {bad}"


def test_no_import_circles():
    graph = {m: {t for t, _, _ in es if t and t != m} for m, es in EDGES.items()}
    state: dict[str, str] = {}
    circles: list[list[str]] = []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, f"import circles: {circles}"


def test_no_imports_of_private_names_across_modules():
    bad = [(m, t, name) for m, es in EDGES.items() for t, name, _ in es
           if t and t != m and name and name.startswith("_") and not name.startswith("__") and (m, t, name) not in KNOWN_PRIVATE]
    assert not bad, f"imports of another module's private names: {bad}"


def test_every_import_of_our_packages_names_a_module_that_exists():
    bad = [(f, n) for f in FILES for n, name, _ in _imports(f)
           if n.split(".")[0] in OURS and n not in MODULES]
    assert not bad, f"imports of modules that do not exist: {bad}"
