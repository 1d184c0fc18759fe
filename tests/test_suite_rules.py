"""The suite's own house rules (tests/README.md): test modules share helpers through conftest.py
and tests/support/, never by importing one another, and no test file grows past 1,000 lines."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_another():
    found = [f"{path.name}:{number}: {line.strip()}"
             for path in sorted(TESTS.glob("test_*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.match(r"\s*(from|import)\s+test_\w+", line)]
    assert found == []


def test_no_test_file_is_over_a_thousand_lines():
    long = {path.name: count for path in sorted(TESTS.glob("test_*.py"))
            if (count := len(path.read_text().splitlines())) > 1000}
    assert long == {}
