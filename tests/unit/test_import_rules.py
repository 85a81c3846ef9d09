"""The import rules of the package, read from the source with ast (nothing is imported; imports
inside functions count as much as those at the top):

- every module belongs to one layer of :data:`LAYERS` and imports only modules of its own layer or
  of a lower one (docs/architecture.md, "Layers");
- the UI (ostinatod/ui) never imports the engine, the server or the daemon: it talks to the daemon
  through the control API client only;
- the residency domain (ostinatod/residency) imports neither the engine nor the server, the control
  API or the daemon, nor llama_cpp or aiohttp;
- the engine (worker process and clients) imports nothing of the server, the control API, the
  daemon or the UI, and no aiohttp;
- the protocol encoders (ostinatod/server/encoders) import no aiohttp and no engine client;
- there is no import cycle between the package's modules (imports inside functions count too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ostinatod"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def imports_of(name: str) -> set[str]:
    """Everything module ``name`` imports, as absolute dotted names (``from a import b`` gives
    ``a.b`` when that is a module of the package, else ``a``)."""
    path = MODULES[name]
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                full = f"{mod}.{a.name}"
                out.add(full if full in MODULES else mod)
    return out


# The layers, lowest first: a module imports only modules of its own layer or a lower one. Each
# entry names modules or packages (every submodule); every module of the package is in one layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("ostinatod", "ostinatod.errors", "ostinatod.paths", "ostinatod.files", "ostinatod.settings",
              "ostinatod.cpus", "ostinatod.hardware", "ostinatod.sessions")),
    ("residency", ("ostinatod.residency",)),
    ("engine", ("ostinatod.engine",)),
    ("synth", ("ostinatod.synth",)),
    ("services", ("ostinatod.desk", "ostinatod.workload", "ostinatod.profile", "ostinatod.discover",
                  "ostinatod.demo")),
    ("server", ("ostinatod.server",)),
    ("control", ("ostinatod.control",)),
    ("daemon", ("ostinatod.daemon",)),
    ("apps", ("ostinatod.daemon_cli", "ostinatod.installer", "ostinatod.cli", "ostinatod.launch",
              "ostinatod.agent_config", "ostinatod.build", "ostinatod.bench", "ostinatod.ui")),
]


def layer_of(name: str) -> int:
    """Index in :data:`LAYERS` of module ``name`` (the longest matching entry); KeyError if none."""
    best, found = -1, None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if (name == e or (e != "ostinatod" and name.startswith(e + "."))) and len(e) > best:
                best, found = len(e), i
    if found is None:
        raise KeyError(name)
    return found


def _internal(name: str) -> set[str]:
    return {m for m in imports_of(name) if m in MODULES and m != name}


def _violations(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for name in MODULES:
        if name == prefix or name.startswith(prefix + "."):
            for m in imports_of(name):
                if any(m == f or m.startswith(f + ".") for f in forbidden):
                    bad.append(f"{name} imports {m}")
    return bad


def test_every_module_has_a_layer():
    missing = []
    for name in MODULES:
        try:
            layer_of(name)
        except KeyError:
            missing.append(name)
    assert missing == [], "add these modules to LAYERS: " + ", ".join(sorted(missing))


def test_no_import_from_a_lower_layer_to_a_higher_one():
    bad = [f"{n} ({LAYERS[layer_of(n)][0]}) imports {m} ({LAYERS[layer_of(m)][0]})"
           for n in sorted(MODULES) for m in sorted(_internal(n)) if layer_of(m) > layer_of(n)]
    assert bad == []


def test_ui_never_imports_the_engine():
    assert _violations("ostinatod.ui", ("ostinatod.engine", "ostinatod.server", "ostinatod.daemon",
                                        "ostinatod.residency", "ostinatod.desk", "llama_cpp")) == []


def test_residency_domain_is_pure():
    assert _violations("ostinatod.residency", ("ostinatod.engine", "ostinatod.server", "ostinatod.control",
                                               "ostinatod.daemon", "ostinatod.desk", "ostinatod.ui",
                                               "llama_cpp", "aiohttp")) == []


def test_engine_does_not_reach_up():
    assert _violations("ostinatod.engine", ("ostinatod.server", "ostinatod.control", "ostinatod.daemon",
                                            "ostinatod.desk", "ostinatod.workload", "ostinatod.ui",
                                            "aiohttp")) == []


def test_encoders_are_pure():
    assert _violations("ostinatod.server.encoders", ("aiohttp", "ostinatod.engine.client",
                                                     "ostinatod.server.common", "ostinatod.server.state",
                                                     "llama_cpp")) == []


def test_no_import_cycles():
    graph = {n: _internal(n) for n in MODULES}
    # a module importing a package's submodule also runs the package's __init__; those __init__
    # files import nothing of the package (checked here), so the graph above is complete
    for n, deps in graph.items():
        if MODULES[n].name == "__init__.py":
            assert not deps, f"{n}/__init__.py imports {sorted(deps)}"
    cycles, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_rules_see_imports():  # the reader itself: relative, absolute and in-function imports
    assert "ostinatod.control.client" in imports_of("ostinatod.ui.tui")
    assert "ostinatod.residency.sets" in imports_of("ostinatod.engine.runtime")
    assert "llama_cpp" in imports_of("ostinatod.engine.loading")
    assert LAYERS[layer_of("ostinatod.residency.planner")][0] == "residency"
    assert LAYERS[layer_of("ostinatod")][0] == "base" and LAYERS[layer_of("ostinatod.daemon_cli")][0] == "apps"
