"""Every argument parser of the standalone benchmarks refuses flag prefixes (``allow_abbrev=False``), as
the ``longflash`` CLIs do: argparse's default took any unambiguous prefix of a flag, so a mistyped or
half-remembered flag ran silently with another meaning (found by a fresh user). The scripts are read with
``ast``, not imported (they import torch/triton at the top)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _parser_calls(path: Path) -> list[ast.Call]:
    """The ``ArgumentParser(...)`` / ``argparse.ArgumentParser(...)`` calls in the file."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name == "ArgumentParser":
                calls.append(node)
    return calls


def _refuses_abbrev(call: ast.Call) -> bool:
    return any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
               for k in call.keywords)


def test_every_benchmark_parser_refuses_flag_prefixes():
    scripts = sorted(BENCHMARKS.glob("*.py"))
    calls = [(p.name, c.lineno, c) for p in scripts for c in _parser_calls(p)]
    assert len(calls) >= 20, f"found only {len(calls)} ArgumentParser calls in {BENCHMARKS}: is the path right?"
    bad = [f"{name}:{line}" for name, line, c in calls if not _refuses_abbrev(c)]
    assert not bad, f"ArgumentParser without allow_abbrev=False (a flag prefix would be taken): {', '.join(bad)}"


def test_the_check_sees_a_parser_that_takes_prefixes(tmp_path):
    """The check itself: a parser with the default (or allow_abbrev=True) is reported."""
    src = tmp_path / "x.py"
    src.write_text("import argparse\nfrom argparse import ArgumentParser\n"
                   "a = argparse.ArgumentParser(description='d')\n"
                   "b = ArgumentParser(allow_abbrev=True)\n"
                   "c = argparse.ArgumentParser(allow_abbrev=False)\n")
    assert [_refuses_abbrev(c) for c in _parser_calls(src)] == [False, False, True]
