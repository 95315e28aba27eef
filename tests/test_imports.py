"""The package's import structure: every module imports alone, and the import graph has no
cycle and points down the layers cli → trainer → experiments → callbacks → core.

The graph is read from the source with ``ast``: every ``import``/``from … import`` of a
growtrain module, at module level or deferred inside a function (a deferred import hides a cycle
from the interpreter but not from a reader). Imports inside a module-level ``__getattr__``
(PEP 562) are not edges: that is how ``growtrain`` loads its Lightning parts on first use. Imports under ``if TYPE_CHECKING:`` never run, but a reader follows them: they must point
down the layers like any other and close no cycle either. A *shim*
(a module that only re-exports) may import from any layer, but not into a cycle; the package
has none today (the pre-release ones were removed).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import growtrain

PACKAGE_DIR = Path(growtrain.__file__).parent

# Highest layer first; a module may import only from its own layer or lower ones.
LAYERS = ("cli", "trainer", "experiments", "callbacks", "core")
LAYER_OF_PREFIX = {
    "growtrain.cli": "cli",
    "growtrain.__main__": "cli",
    "growtrain.trainer": "trainer",
    "growtrain.experiments": "experiments",
    "growtrain.callbacks": "callbacks",
}


def layer(module: str) -> str:
    """The layer of ``module``: the first prefix in LAYER_OF_PREFIX it falls under, else core."""
    for prefix, name in LAYER_OF_PREFIX.items():
        if module == prefix or module.startswith(prefix + "."):
            return name
    return "core"


def package_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ["growtrain", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _lazy_getattr_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes inside module-level ``def __getattr__`` (lazy, deprecated re-exports)."""
    return {
        id(inner)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        for inner in ast.walk(node)
    }


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) anywhere."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                out |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path], *, include_type_only: bool = True) -> set[str]:
    """The growtrain modules that module ``name`` (source at ``path``) imports, anywhere in it
    (``include_type_only=False``: leaving out the imports under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lazy = _lazy_getattr_nodes(tree)
    if not include_type_only:
        lazy |= _type_checking_nodes(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb level-1 packages up from this module's package
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"  # `from growtrain import probe_math`
                found.add(submodule if submodule in modules else source)
    return {m for m in found if m in modules and m != name}


def is_shim(path: Path) -> bool:
    """Whether a module only re-exports: docstring, imports, ``__all__``/``__getattr__``
    assignments, warning calls, and a ``__getattr__`` function; nothing else."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # docstring
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):  # warnings.warn(...)
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name == "warn":
                continue
            return False
        reexports = ("__all__", "__getattr__")
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id in reexports for t in node.targets):
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            continue
        return False
    return True


def import_graph(*, include_type_only: bool = True) -> dict[str, set[str]]:
    modules = package_modules()
    return {
        name: imported_modules(name, path, modules, include_type_only=include_type_only)
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path ``[a, b, …, a]``, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


# -- the checks on the graph ----------------------------------------------------------------------
def test_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph(include_type_only=False))
    assert cycle is None, "import cycle among growtrain modules: " + " → ".join(cycle)


def test_no_cycle_even_through_type_only_imports():
    """A reader follows an annotation's import too: decision.py once named saturation.py's report
    under TYPE_CHECKING while saturation.py imported decision.py (the report's own functions now
    live in saturation_report.py)."""
    cycle = find_cycle(import_graph(include_type_only=True))
    assert cycle is None, "import cycle among growtrain modules (type-only imports included): " + " → ".join(cycle)


def test_imports_point_down_the_layers():
    modules = package_modules()
    upward = [
        f"{src} ({layer(src)}) imports {dst} ({layer(dst)})"
        for src, targets in import_graph().items()
        if not is_shim(modules[src])
        for dst in sorted(targets)
        if LAYERS.index(layer(dst)) < LAYERS.index(layer(src))
    ]
    assert not upward, "imports against cli → trainer → experiments → callbacks → core:\n" + "\n".join(upward)


# -- the checker itself, on made-up modules -------------------------------------------------------
def test_graph_reader_sees_deferred_and_relative_imports_but_not_lazy_reexports(tmp_path):
    source = textwrap.dedent(
        """
        from growtrain import probe_math as pm
        from . import report

        def late():
            from growtrain.crossfit import CrossFitState

        def __getattr__(name):
            from growtrain.trainer import GrowTrainer

        if TYPE_CHECKING:
            from growtrain.saturation import SaturationReport
        """
    )
    path = tmp_path / "fake.py"
    path.write_text(source)
    modules = package_modules()
    found = imported_modules("growtrain.fake", path, modules)
    assert found == {"growtrain.probe_math", "growtrain.report", "growtrain.crossfit", "growtrain.saturation"}
    assert imported_modules("growtrain.fake", path, modules, include_type_only=False) == found - {"growtrain.saturation"}


def test_cycle_finder_and_layers_on_known_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    cycle = find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert [layer(m) for m in ("growtrain.cli", "growtrain.trainer", "growtrain.experiments.runs",
                               "growtrain.callbacks.compute", "growtrain.callbacks", "growtrain.saturation")] == [
        "cli", "trainer", "experiments", "callbacks", "callbacks", "core"]  # fmt: skip


def test_shim_detection(tmp_path):
    shim = tmp_path / "shim.py"
    shim.write_text(
        '"""Moved."""\nimport warnings\nfrom growtrain.callbacks.growth import *\n'
        'warnings.warn("moved", DeprecationWarning)\n__all__ = ["X"]\n'
    )
    real = tmp_path / "real.py"
    real.write_text("import torch\nX = 1\n")
    assert is_shim(shim) and not is_shim(real)


# -- every module imports alone -------------------------------------------------------------------
# Third-party packages are imported once, then each growtrain module is imported in a forked
# child that has no growtrain module loaded yet: as fresh as a new interpreter for the package,
# without paying torch's import time per module.
_IMPORT_EACH = textwrap.dedent(
    """
    import importlib, os, sys, traceback, warnings
    import torch, lightning.pytorch, torchmetrics, matplotlib, rich, jsonargparse  # noqa: F401
    failed = []
    for name in sys.argv[1:]:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    importlib.import_module(name)
                own = [w for w in caught if issubclass(w.category, DeprecationWarning) and "growtrain." in str(w.message)]
                if own and name not in os.environ["SHIMS"].split(","):
                    print(f"{name}: importing it uses a deprecated growtrain path: {own[0].message}")
                    code = 2
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status:
            failed.append(name)
    print("FAILED:", ",".join(failed))
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="imports each module in a forked child")
def test_every_module_imports_alone():
    modules = package_modules()
    shims = ",".join(n for n, p in modules.items() if is_shim(p))  # they warn on import, by design
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork after threads: the child only imports
        result = subprocess.run(
            [sys.executable, "-c", _IMPORT_EACH, *modules],
            capture_output=True, text=True, timeout=600, env={**os.environ, "SHIMS": shims},
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    failed = result.stdout.strip().splitlines()[-1].removeprefix("FAILED:").strip()
    assert not failed, f"modules that fail to import alone: {failed}\n{result.stdout[-4000:]}{result.stderr[-4000:]}"


# -- growable.py sits below families/ --------------------------------------------------------------
# families/ build their blocks on growable.py's contract, so growable.py must not reach up into them,
# not even from inside a function (a deferred import hides the upward edge from the interpreter).
def _families_imports(name: str, path: Path) -> list[str]:
    """What module ``name`` (source at ``path``) imports from ``growtrain.families``, anywhere in it:
    ``import``/``from … import`` statements (deferred ones too), and ``importlib.import_module`` /
    ``__import__`` calls with a literal module name."""
    modules = package_modules()
    found = {m for m in imported_modules(name, path, modules) if m == "growtrain.families" or m.startswith("growtrain.families.")}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            target = node.args[0].value
            if called in ("import_module", "__import__") and isinstance(target, str) and target.startswith("growtrain.families"):
                found.add(target)
    return sorted(found)


def test_growable_does_not_import_the_families_built_on_it():
    path = PACKAGE_DIR / "growable.py"
    assert not _families_imports("growtrain.growable", path), (
        "growtrain/growable.py imports growtrain.families (families build on growable.py, not the reverse): "
        + ", ".join(_families_imports("growtrain.growable", path))
    )


def test_families_import_reader_sees_deferred_and_dynamic_imports(tmp_path):
    path = tmp_path / "growable.py"
    path.write_text(textwrap.dedent(
        """
        import importlib

        def late():
            from growtrain.families.generic import ResidualAdapter

        def dynamic():
            return importlib.import_module("growtrain.families.basic")
        """
    ))  # fmt: skip
    assert _families_imports("growtrain.growable", path) == ["growtrain.families.basic", "growtrain.families.generic"]
    path.write_text("from growtrain.probe_math import DenseFeatures\n")
    assert _families_imports("growtrain.growable", path) == []


# -- bench/ uses the library's public names only -----------------------------------------------------
BENCH_DIR = PACKAGE_DIR.parent / "bench"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_growtrain_uses(path: Path) -> list[str]:
    """Private growtrain names a script uses: ``from growtrain… import _name``, a private growtrain
    module (``growtrain._x``) imported in any form, and ``alias._name`` on a name bound to a
    growtrain module by ``import``. As ``path:line name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "growtrain":
            parts = node.module.split(".")
            out += [f"{path.name}:{node.lineno} {node.module}" for p in parts if _private(p)]
            for alias in node.names:
                if _private(alias.name):
                    out.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
                elif f"{node.module}.{alias.name}" in package_modules():  # `from growtrain import crossfit`
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "growtrain":
                    out += [f"{path.name}:{node.lineno} {alias.name}" for p in alias.name.split(".") if _private(p)]
                    aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):  # growtrain.crossfit._x: the chain's first name
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return sorted(out, key=lambda use: int(use.split(" ")[0].rsplit(":", 1)[1]))  # in line order


def test_bench_scripts_import_no_private_growtrain_name():
    scripts = sorted(BENCH_DIR.glob("*.py"))
    assert scripts, f"no bench scripts under {BENCH_DIR}"
    found = [use for path in scripts for use in private_growtrain_uses(path)]
    assert not found, (
        "bench/ uses private growtrain names; make the name public in the library (and update its callers) or "
        "use the public API:\n" + "\n".join(found)
    )


def test_private_use_reader_on_a_made_up_script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(
        """
        import growtrain.crossfit as cf
        from growtrain import probe_math
        from growtrain.crossfit import normal_quantile, _hidden
        from growtrain._secret import thing
        from trial_study import _local  # a sibling script's name, not growtrain's

        cf._check(1)
        probe_math._inner
        cf.__name__
        """
    ))  # fmt: skip
    assert private_growtrain_uses(path) == [
        "script.py:4 growtrain.crossfit._hidden", "script.py:5 growtrain._secret",
        "script.py:8 cf._check", "script.py:9 probe_math._inner",
    ]  # fmt: skip
    path.write_text("import growtrain.crossfit as cf\nfrom growtrain.crossfit import normal_quantile\ncf.normal_quantile(0.5)\n")
    assert private_growtrain_uses(path) == []
