"""No module imports one from a layer above it, not even inside a function: the parts stay
usable on their own (a drafter without the engine, the engine without the CLI)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_spec"
# Lowest first; a module may import from its own layer and those below.
LAYERS = [
    {"errors", "events"},
    {"hub", "sampling", "cost", "cache", "verify", "logprobs", "tree", "models", "suffix_memory"},
    {"drafters"},
    {"policy", "engine", "batch", "distributed", "config", "auto"},
    {"convert", "train", "bench", "bench_suite"},
    {"api"},
    {"server"},
    {"cli"},
]
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def part_of(module: Path) -> str:
    """The top-level part of mlx_spec a file belongs to ("engine", "drafters", ...)."""
    return module.relative_to(PACKAGE).parts[0].removesuffix(".py")


def imported_parts(module: Path):
    """(line, part) of every import of mlx_spec's own modules, relative or absolute."""
    tree = ast.parse(module.read_text())
    package = module.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # e.g. mlx_spec, drafters
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + tuple(
                    (node.module or "").split(".") if node.module else ()
                )
            else:
                base = tuple((node.module or "").split("."))
            if base[:1] != ("mlx_spec",):
                continue
            names = [base[1]] if len(base) > 1 else [alias.name for alias in node.names]
            for name in names:
                yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "mlx_spec" and len(parts) > 1:
                    yield node.lineno, parts[1]


def test_no_module_imports_from_a_layer_above():
    violations = []
    for module in sorted(PACKAGE.rglob("*.py")):
        part = part_of(module)
        if part in ("__init__", "__main__"):  # the package's facade: `mlx_spec.load`, `python -m mlx_spec`
            continue
        assert part in LAYER, f"{module}: place {part!r} in a layer"
        for line, imported in imported_parts(module):
            if imported in LAYER and LAYER[imported] > LAYER[part]:
                violations.append(f"{module.relative_to(PACKAGE)}:{line} ({part}) imports {imported}")
    assert not violations, "\n".join(violations)


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """The check itself: an engine that imported the CLI inside a function is seen."""
    fake = tmp_path / "mlx_spec"
    fake.mkdir()
    (fake / "engine.py").write_text("def f():\n    from .cli import main\n    import mlx_spec.api\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert list(imported_parts(fake / "engine.py")) == [(2, "cli"), (3, "api")]
