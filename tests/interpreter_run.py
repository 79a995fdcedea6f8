"""Shared by the kernel tests that run a script under ``TRITON_INTERPRET=1`` in a subprocess (the flag
must be set before Triton is first imported): run it and return the JSON it prints after ``RESULT``."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(script: str, timeout_s: int = 600) -> dict:
    """Run ``script`` (Python source) with the Triton interpreter on one thread; fails the test with the
    script's stderr when it fails, skips it without Triton. Returns the last ``RESULT{json}`` line's data."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])
