"""The package's layers, read from its source: every import between mla's modules (those inside
functions too) goes down the layers, and there is no import cycle.

From the bottom up: _runtime; layout; reference; kernels and configs (neither imports the
other); dispatch; api; ops, flash_mla, validate, bench, aot and tuning above them; the package
itself on top.
"""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "mla"

#: (layer, group) of each top-level part of the package; a module may import only from a lower
#: layer, or from its own group
LAYERS = {"_runtime": (0, "_runtime"), "layout": (1, "layout"), "reference": (2, "reference"),
          "kernels": (3, "kernels"), "configs": (3, "configs"), "dispatch": (4, "dispatch"), "api": (5, "api"),
          "ops": (6, "ops"), "flash_mla": (6, "flash_mla"), "validate": (6, "validate"), "bench": (6, "bench"),
          "aot": (6, "aot"), "tuning": (6, "tuning"),
          "schedule": (3, "schedule")}


def _module_name(path: pathlib.Path) -> str:
    parts = ["mla", *path.relative_to(PKG).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(name: str, level: int, here: str, is_pkg: bool) -> str:
    if level == 0:
        return name
    base = here.split(".") if is_pkg else here.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(modules: dict) -> dict:
    """{module: {imported mla modules}}, from every import statement of its source."""
    out = {}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        got = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node.module or "", node.level, mod, is_pkg)
                # `from . import x` names a submodule when there is one
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            else:
                continue
            got.update(n for n in names if n == "mla" or n.startswith("mla."))
        out[mod] = {n for n in got if n in modules and n != mod}
    return out


def _part(mod: str):
    parts = mod.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else (99, "mla")


def test_every_module_has_a_layer():
    missing = [m for m in _modules() if m != "mla" and _part(m) is None]
    assert not missing, f"modules with no layer in LAYERS: {missing}"


def test_imports_go_down_the_layers():
    bad = []
    for mod, deps in imports(_modules()).items():
        lm, gm = _part(mod)
        for d in deps:
            ld, gd = _part(d)
            if not (ld < lm or gd == gm or (lm == ld == 6)):
                bad.append(f"{mod} -> {d}")
    assert not bad, "imports that go up or sideways: " + ", ".join(sorted(bad))


def test_kernels_and_configs_do_not_import_each_other():
    graph = imports(_modules())
    for mod, deps in graph.items():
        if mod.startswith("mla.kernels"):
            assert not any(d.startswith("mla.configs") for d in deps), (mod, deps)
        if mod.startswith("mla.configs"):
            assert not any(d.startswith("mla.kernels") for d in deps), (mod, deps)


def test_there_is_no_import_cycle():
    graph = imports(_modules())
    graph = {m: {d for d in deps if d != "mla"} for m, deps in graph.items() if m != "mla"}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in graph.get(m, ()):
            if state.get(d) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_the_reader_finds_the_imports_it_should():
    """The reader itself: a relative import, one inside a function, and `from . import x`."""
    graph = imports(_modules())
    assert "mla.layout" in graph["mla.api"] and "mla.dispatch" in graph["mla.api"]
    assert "mla.kernels.gluon_sm90" in graph["mla.dispatch"]
    assert "mla.kernels.common" in graph["mla.kernels.tl_dot"]
