"""The code's shape, kept by a test rather than by memory: no module over 500
lines, and a function over 80 lines says why in a comment (`# long: ...` on
the line above its `def` or among its first lines)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("edgellm", "quant", "tui")
MAX_MODULE = 500
MAX_FUNCTION = 80


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def long_functions(path: Path, root: Path = ROOT) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            n = node.end_lineno - start + 1
            if n <= MAX_FUNCTION:
                continue
            near = lines[max(0, start - 3) : node.body[0].lineno + 4]
            if not any(ln.strip().startswith("# long:") for ln in near):
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_module_over_500_lines():
    big = [
        f"{p.relative_to(ROOT)} ({n})" for p in _modules() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE
    ]
    assert not big, "split these modules: " + ", ".join(big)


def test_long_functions_say_why():
    bad = [f for p in _modules() for f in long_functions(p)]
    assert not bad, "over 80 lines without a `# long:` comment saying why: " + "; ".join(bad)


def test_the_checker_sees_a_long_function_and_its_reason(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(90))
    f = tmp_path / "m.py"
    f.write_text(f"def f():\n{body}\n")
    assert long_functions(f, tmp_path) == ["m.py:1 f (91 lines)"]
    f.write_text(f"# long: one table, read top to bottom\ndef f():\n{body}\n")
    assert long_functions(f, tmp_path) == []
