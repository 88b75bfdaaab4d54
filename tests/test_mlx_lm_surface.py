"""What mlx-spec uses of mlx-lm, checked against the installed mlx-lm: every name it imports from
mlx-lm (read from mlx_spec's own source, so a new import is checked without a list to keep),
and the private attributes it reads and writes. pyproject.toml bounds mlx-lm to the versions
tested; a newer mlx-lm that moves one of these fails here, loudly, before any wrong token."""

import ast
import importlib
from pathlib import Path

import mlx.core as mx

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_spec"


def imported_from_mlx_lm():
    """(module, name, where) of every `from mlx_lm... import name` in mlx_spec."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").split(".")[0] == "mlx_lm"
            ):
                for alias in node.names:
                    yield node.module, alias.name, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def test_every_name_imported_from_mlx_lm_exists():
    names = list(imported_from_mlx_lm())
    assert len(names) > 20  # the scan finds them
    missing = [
        f"{where}: {module}.{name}"
        for module, name, where in names
        if not hasattr(importlib.import_module(module), name)
    ]
    assert not missing, "mlx-lm no longer has:\n" + "\n".join(missing)


def test_the_private_attributes_used_are_there():
    from mlx_lm.models.cache import RotatingKVCache
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.utils import _get_classes

    # cache.py rolls a rotating cache back by its write index `_idx` (and reads keep, max_size).
    cache = RotatingKVCache(max_size=8, keep=2)
    cache.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    assert (cache._idx, cache.offset, cache.keep, cache.max_size) == (3, 3, 2, 8)
    # convert/hf.py checks an architecture with mlx-lm's own class lookup.
    assert callable(_get_classes)
    # The server reads the tokenizer wrapper's tool-calling and thinking markers.
    for name in (
        "has_tool_calling",
        "tool_call_start",
        "tool_call_end",
        "tool_parser",
        "has_thinking",
        "think_start",
        "think_end",
        "detokenizer",
        "eos_token_ids",
    ):
        assert hasattr(TokenizerWrapper, name), name
