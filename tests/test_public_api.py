"""`import profiler_svc` names its public API once: lazily for speed, statically for linters and IDEs."""
import ast
from pathlib import Path

import profiler_svc


def test_every_export_is_listed_imported_for_type_checkers_and_resolves():
    tree = ast.parse(Path(profiler_svc.__file__).read_text())
    checked = {alias.name for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", None) == "TYPE_CHECKING"
               for stmt in node.body for alias in stmt.names}
    assert sorted(profiler_svc._EXPORTS) == profiler_svc.__all__ == sorted(checked)
    for name in profiler_svc.__all__:
        assert getattr(profiler_svc, name) is not None
