"""The suite's own house rules (tests/README.md): test modules share helpers through tests/support/
(conftest.py holds fixtures and hooks only, and nothing imports it), never by importing one
another, and no test file grows past 1,000 lines."""

from __future__ import annotations

import ast
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


def test_conftest_holds_fixtures_only_and_nothing_imports_it():
    tree = ast.parse((TESTS / "conftest.py").read_text())
    helpers = [node.name for node in tree.body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))
               and not node.name.startswith("pytest_")
               and not any("fixture" in ast.unparse(decorator) for decorator in
                           getattr(node, "decorator_list", []))]
    importers = [path.name for path in sorted(TESTS.rglob("*.py"))
                 if re.search(r"^\s*(from conftest import|import conftest)", path.read_text(), re.M)]
    assert (helpers, importers) == ([], [])


def test_tests_say_what_they_hold_not_which_ticket_asked():
    """A test names the behaviour it holds; a ticket's number means nothing to a reader of the
    suite (the tracker is not in the repository)."""
    found = [f"{path.relative_to(TESTS)}:{number}"
             for path in sorted(TESTS.rglob("*.py")) if path.name != "test_docs.py"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\b[Ii]ssue \d+|\bPITFALLS\b", line)]
    assert found == []
