"""Security: SQL is never built from strings in the database-facing modules.

Every query is a SQLAlchemy expression with bound parameters. The check walks the syntax
tree: no f-string, %-formatting, .format() or concatenation may produce SQL, and raw-SQL
entry points (text(), exec_driver_sql(), literal_column()) only take constants.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MODULES = [
    *sorted((ROOT / "api" / "db").glob("*.py")),
    *sorted((ROOT / "api" / "keys").glob("*.py")),
    *sorted((ROOT / "api" / "tenants").glob("*.py")),
    *sorted((ROOT / "api" / "quotas").glob("*.py")),
    *sorted((ROOT / "api" / "usage").glob("*.py")),
    ROOT / "api" / "server" / "guards.py",
    *sorted((ROOT / "api" / "cli").glob("*.py")),
    ROOT / "api" / "admin" / "routes.py",
    ROOT / "migrations" / "env.py",
    *sorted((ROOT / "migrations" / "versions").glob("*.py")),
]
SQL = re.compile(
    r"\b(select|insert|update|delete|drop|create|alter|pragma|begin|where|values)\b", re.I
)
RAW_SQL_CALLS = {"text", "exec_driver_sql", "literal_column"}


def _constant_text(node: ast.AST) -> str:
    return " ".join(
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )


def _is_constant_string(node: ast.AST) -> bool:
    if isinstance(node, ast.IfExp):  # "A" if flag else "B"
        return _is_constant_string(node.body) and _is_constant_string(node.orelse)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _violations(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        built = (
            isinstance(node, ast.JoinedStr)
            or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add))
            or (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "format"
            )
        )
        if built and SQL.search(_constant_text(node)):
            found.append(f"{path.name}:{node.lineno}: SQL built from a string")
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in RAW_SQL_CALLS and not all(_is_constant_string(a) for a in node.args):
                found.append(f"{path.name}:{node.lineno}: {name}() with a non-constant")
    return found


def test_modules_exist() -> None:
    assert all(p.is_file() for p in MODULES)
    assert len(MODULES) >= 12


def test_no_sql_built_from_strings() -> None:
    problems = [v for path in MODULES for v in _violations(path)]
    assert problems == []


def test_the_checker_catches_string_sql(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(conn, key, table):\n"
        "    conn.execute(f\"SELECT * FROM api_keys WHERE id = '{key}'\")\n"
        "    conn.execute('DELETE FROM %s' % table)\n"
        "    conn.execute('UPDATE t SET a = ' + key)\n"
        "    conn.execute('select 1 where x = {}'.format(key))\n"
        "    conn.exec_driver_sql(key)\n"
        "    text(key)\n"
    )
    assert len(_violations(bad)) == 6
