"""Each rule of the product is written in one place: the store's paths in ``StoreLayout``, the formulas in
the contract's formulas module (busbw factors in its bandwidth module). A second spelling drifts: these
tests read every product and bench source (code, not comments or docstrings) for the rule's tell-tale
expressions."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("agent", "dashboard", "trainer", "grafana", "meshscope", "bench")

# rule -> (its home, whether string literals spell it, patterns that spell it). The code is read as its
# tokens joined by single spaces. A formula is computed, so the formulas are looked for outside strings (a
# label such as "6*N + 12*L*D*S" names one); a path is spelled in strings.
RULES = {
    "store paths": ("agent/contract/storelayout.py", True, [
        r"""/ ["'](tables|spool|packs|agent|offsets\.json|agent\.lock)["']""",  # joined onto a path
        r"""f?["'](tables|spool)/""",  # a key below a store or a bucket prefix
        r"""f?["'](run|rank)=(?!~)""",  # a hive partition directory (not PromQL's run=~)
    ]),
    "FLOPs per token": ("agent/contract/formulas.py", False, [r"\b6(\.0)? \* [\w.]+ \+ 12(\.0)? \*"]),
    "MFU": ("agent/contract/formulas.py", False, [r"/ (\w+ \. )?peak_flops\b", r"/ PEAK_FLOPS\b"]),
    "bubble closed form": ("agent/contract/formulas.py", False, [r"\( p - 1 \) / \("]),
    "busbw factors": ("agent/contract/bandwidth.py", False, [r"\( n - 1 \) / n\b"]),
}


def _code(path: Path, *, strings: bool) -> str:
    """The source's tokens, one line per source line, comments and docstrings left out (other string
    literals too unless ``strings``)."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.add((first.lineno, first.col_offset))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and (tok.start in docstrings or not strings)):
            continue
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        out.append((tok.start, tok.string))
    lines: dict[int, list[str]] = {}
    for (row, _), s in out:
        lines.setdefault(row, []).append(s)
    return "\n".join(f"{row}: {' '.join(parts)}" for row, parts in sorted(lines.items()))


FILES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
SOURCES = {strings: {p.relative_to(ROOT).as_posix(): _code(p, strings=strings) for p in FILES} for strings in (True, False)}


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_is_spelled_only_in_its_home(rule):
    home, strings, patterns = RULES[rule]
    found = sorted(f"{path}:{line.split(':')[0]}" for path, code in SOURCES[strings].items() if path != home
                   for line in code.splitlines() if any(re.search(p, line) for p in patterns))
    assert found == [], f"{rule} spelled outside {home}: {found}"


def test_the_patterns_find_the_rules_in_their_homes():
    """A pattern that matches nothing proves nothing: each finds its rule where it lives."""
    for rule, (home, strings, patterns) in RULES.items():
        lines = SOURCES[strings][home].splitlines()
        assert any(re.search(p, line) for p in patterns for line in lines), rule
