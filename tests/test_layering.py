"""The package's structure: no private name crosses a module, no import cycle, each layer in its folder.

A module reaches another only through its public names: it neither imports
nor reads an ``_``-prefixed name defined elsewhere, nor overrides one in a
subclass. The layers import one way: ``parallel`` and ``ops`` know nothing of
the others; ``metric`` builds on them; ``logging`` on nothing; ``tracker`` (the
step record) on ``metric`` and ``logging``; ``megatron`` (the hooks into
Megatron's model, ``forward_step`` and loop, which drive the tracker's step-health
pieces inside Megatron's own ``pretrain()``) on all of those; ``cli`` and
``plots`` on everything. ``testing`` (the CPU
shim and other support for tests, the CPU demo and the documentation's examples)
is a top layer that may use any other and that nothing in the library imports.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import twinkle_megatron

PACKAGE = Path(twinkle_megatron.__file__).parent
MODULES = sorted(name for _, name, _ in pkgutil.walk_packages([str(PACKAGE)], "twinkle_megatron.")
                 if name != "twinkle_megatron.ops.triton_token_stats")  # needs Triton; scanned as text below
FILES = sorted(PACKAGE.rglob("*.py"))
# Private names of other packages read on purpose, each for want of a public API.
EXTERNAL_PRIVATE = {
    "torch._C": "router_hooks: _current_graph_task_id tells a forward recomputed inside backward",
    "_version": "router_hooks: a tensor's version counter tells whether Megatron's aux-loss tracker was written",
    "_foreach_add_": "token_sums: torch's multi-tensor add (what torch.optim's foreach path uses): a metric's "
                     "sums of a microbatch added to their states in one op, one launch on an accelerator",
    "_foreach_maximum_": "token_sums: torch's multi-tensor maximum, likewise for a metric's maxima",
    "_AutoDispatchBelowAutograd": "testing.guards: the collective-counting kernel (registered for c10d's autograd "
                                  "keys) hands the op on to its kernels below autograd, as torch's own do",
    "_destroy": "testing.guards: the counting kernels are removed when the last count closes (torch.library's "
                "Library has no public way to remove what it registered)",
    "os._exit": "testing.distributed: a forked worker leaves without the parent's atexit handlers (the stdlib's "
                "documented way out of a forked child)",
}
# Which layers each layer may import (besides itself and the top-level keys and version modules).
ALLOWED = {
    "parallel": set(),
    "ops": {"parallel"},
    "metric": {"parallel", "ops"},
    "logging": set(),
    "tracker": {"parallel", "metric", "logging"},
    "megatron": {"parallel", "ops", "metric", "logging", "tracker"},
    "testing": {"parallel", "ops", "metric", "megatron", "logging", "tracker"},
}
# Inside metric/, the pipeline's layers (twinkle_megatron/metric/__init__.py): which each may import.
METRIC_LAYERS = {
    "inputs": set(),
    "state": {"inputs"},
    "tokens": {"inputs", "state"},
    "language": {"inputs", "state", "tokens"},
    "rl": {"inputs", "state", "tokens"},
    "collection": {"inputs", "state", "tokens", "language", "rl"},
}
# Layers that use the metrics through the package's public names only (twinkle_megatron.metric.__all__).
METRIC_CLIENTS = ("megatron", "tracker")
# Support for tests and CPU demos: never on the library's path.
TOP_ONLY = "twinkle_megatron.testing"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) of every import of the package in ``path``, at any depth."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("twinkle_megatron"):
                found.append((module, [alias.name for alias in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names
                      if alias.name.startswith("twinkle_megatron")]
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_name_is_imported_or_read_across_modules(path):
    offences = [f"line {line}: imports {name} from {module}" for module, names, line in _imports(path)
                for name in names if name.startswith("_") and not name.startswith("__")]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            is_self = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            is_super = isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super"
            external = ast.unparse(node) in EXTERNAL_PRIVATE or node.attr in EXTERNAL_PRIVATE
            if not (is_self or is_super or external):
                offences.append(f"line {node.lineno}: reads {ast.unparse(node)}")
    assert not offences, "\n".join(offences)


@pytest.mark.parametrize("name", MODULES)
def test_no_private_method_overrides_one_of_another_module(name):
    module = importlib.import_module(name)
    offences = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != name:
            continue
        for attribute in vars(cls):
            if not attribute.startswith("_") or attribute.startswith("__"):
                continue
            for base in cls.__mro__[1:]:
                if attribute in vars(base) and base.__module__.startswith("twinkle_megatron") \
                        and base.__module__ != name:
                    offences.append(f"{cls.__name__}.{attribute} overrides {base.__module__}.{base.__name__}")
    assert not offences, "\n".join(offences)


def _graph() -> dict[str, set[str]]:
    names = {_module_name(path) for path in FILES}
    graph: dict[str, set[str]] = {}
    for path in FILES:
        targets = set()
        for module, imported, _ in _imports(path):
            for target in [f"{module}.{item}" for item in imported] + [module]:
                if target in names:
                    targets.add(target)
                    break
        graph[_module_name(path)] = targets - {_module_name(path)}
    return graph


def test_no_import_cycle_inside_the_package():
    graph = _graph()
    # Importing a package runs its __init__, which imports its modules: a package's own modules are not a cycle.
    edges = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in edges.get(node, ()):
            if state.get(target) == 1:
                cycles.append(" -> ".join(trail[trail.index(target):] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_the_package_root():
    """The root ``__init__`` imports every layer: a module importing it (even inside a function) closes a cycle
    that the cycle check above cannot see, since it counts a package's own modules importing it as no cycle."""
    offences = [f"{_module_name(path)} line {line}: imports {module} ({', '.join(names)})"
                for path in FILES if path != PACKAGE / "__init__.py"
                for module, names, line in _imports(path) if module == "twinkle_megatron"
                and not all(f"twinkle_megatron.{name}" in {_module_name(p) for p in FILES} for name in names)]
    assert not offences, "\n".join(offences)


def test_layers_import_one_way():
    offences = []
    for module, targets in _graph().items():
        layer = module.split(".")[1] if module.count(".") >= 1 else ""
        if layer not in ALLOWED:
            continue
        for target in targets:
            other = target.split(".")[1] if target.count(".") >= 1 else ""
            if other and other != layer and other not in ("keys", "version") and other not in ALLOWED[layer]:
                offences.append(f"{module} imports {target}")
    assert not offences, "\n".join(offences)


def test_nothing_in_the_library_imports_the_testing_support():
    offences = [f"{module} imports {target}" for module, targets in _graph().items()
                if not (module == TOP_ONLY or module.startswith(TOP_ONLY + "."))
                for target in targets if target == TOP_ONLY or target.startswith(TOP_ONLY + ".")]
    assert not offences, "\n".join(offences)


def test_the_testing_package_init_imports_nothing():
    """``twinkle_megatron/testing/__init__.py`` imports nothing: a script takes the one module it needs."""
    tree = ast.parse((PACKAGE / "testing" / "__init__.py").read_text())
    imports = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports == [], imports


def test_metric_layers_import_one_way():
    """inputs -> state -> tokens -> the metrics (language, rl: neither imports the other) -> the collection."""
    offences = []
    for module, targets in _graph().items():
        parts = module.split(".")
        if parts[:2] != ["twinkle_megatron", "metric"] or len(parts) < 3:
            continue
        layer = parts[2]
        assert layer in METRIC_LAYERS, f"{module}: a metric module outside the layers {sorted(METRIC_LAYERS)}"
        for target in targets:
            other = target.split(".")
            if other[:2] == ["twinkle_megatron", "metric"] and len(other) > 2 and other[2] != layer \
                    and other[2] not in METRIC_LAYERS[layer]:
                offences.append(f"{module} imports {target}")
    assert not offences, "\n".join(offences)


def test_the_hooks_and_the_tracker_use_the_metrics_public_names():
    import twinkle_megatron.metric as metric

    offences = []
    for path in FILES:
        module = _module_name(path)
        if module.split(".")[1:2] not in ([layer] for layer in METRIC_CLIENTS):
            continue
        for target, names, line in _imports(path):
            if target.startswith("twinkle_megatron.metric."):
                offences.append(f"{module} line {line}: imports {target} (use twinkle_megatron.metric's names)")
            elif target == "twinkle_megatron.metric":
                offences += [f"{module} line {line}: {name} is not in twinkle_megatron.metric.__all__"
                             for name in names if name not in metric.__all__]
    assert not offences, "\n".join(offences)
