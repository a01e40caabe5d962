"""No class in the package grows past 300 lines: a bigger one holds several jobs, and the next
model family or protocol would thread through all of them (split it into collaborators)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ferrum_mac"
MOST_LINES = 300


def test_no_class_is_over_300_lines():
    big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MOST_LINES:
                big.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not big, f"classes over {MOST_LINES} lines: {', '.join(big)}"
