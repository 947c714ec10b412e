"""Two interfaces used across folders take only the names their module publishes (``__all__``), never its
private ``_names``: the ZeRO checkpoint reader ``ds_zero.zero_to_fp32`` used by the Universal Checkpoint
converters (``deepspeed/checkpoint/``), and the expert groups ``ds_moe.groups`` used by AutoEP (``ds_moe/autoep/``;
there the underscored names DeepSpeed itself gives its expert-group API are listed in ``__all__``)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2] / "packages"
CASES = [("ds_zero.zero_to_fp32", PACKAGES / "deepspeed/src/deepspeed/checkpoint"),
         ("ds_moe.groups", PACKAGES / "ds-moe/src/ds_moe/autoep")]


def _names_taken(module: str, path: Path) -> set[str]:
    """Names of ``module`` a file uses: ``from module import x`` and ``alias.x`` for an alias bound to it."""
    parent, _, leaf = module.rpartition(".")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases, taken = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if node.module == parent and alias.name == leaf:
                    aliases.add(alias.asname or alias.name)
                elif node.module == module:
                    taken.add(alias.name)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == module and a.asname)
    taken.update(node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id in aliases)
    return taken


@pytest.mark.parametrize(("module", "users"), CASES, ids=[m for m, _ in CASES])
def test_users_take_only_published_names(module, users):
    published = set(importlib.import_module(module).__all__)
    taken = {(path.name, name) for path in sorted(users.rglob("*.py")) for name in _names_taken(module, path)}
    assert taken, f"no file under {users} uses {module}: the check would prove nothing"
    private = sorted((file, name) for file, name in taken if name.startswith("_") and name not in published)
    assert private == [], f"private names of {module} used from {users.relative_to(PACKAGES)}"
    unlisted = sorted((file, name) for file, name in taken if name not in published)
    assert unlisted == [], f"names of {module} used from {users.relative_to(PACKAGES)} but missing from __all__"
