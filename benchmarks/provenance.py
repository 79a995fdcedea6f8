"""The commit a benchmark ran at, for its results file.

GPU calls run a ``git archive`` copy of a commit inside the checkout (``.gpusuite/``, with the commit in a
``COMMIT`` file at its root); ``git rev-parse`` there names the surrounding checkout's HEAD instead, so
the marker wins. Otherwise ``git rev-parse HEAD`` of the repository, with ``-dirty`` when ``longflash/``
or ``benchmarks/`` have uncommitted changes to tracked files; ``unknown`` without git.
"""
from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit(short: bool = False) -> str:
    """The commit of this copy of the code (40 hex digits, or 7 with ``short``), as described above."""
    marker = os.path.join(REPO, "COMMIT")
    if os.path.isfile(marker):
        sha = open(marker).read().strip()
        return sha[:7] if short else sha
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "longflash",
                                "benchmarks"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    if not sha:
        return "unknown"
    return (sha[:7] if short else sha) + ("-dirty" if dirty else "")
