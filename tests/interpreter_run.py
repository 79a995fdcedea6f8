"""Shared by the tests that run Triton kernels in the CPU interpreter: ``TRITON_INTERPRET`` must be set
before Triton is imported, so the test file runs itself in a subprocess with it set (its ``__main__``
prints a JSON report as its last line) and the test reads that report."""

import json
import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interpreter_report(test_file: str, timeout_s: int = 600):
    """Run ``test_file`` with ``TRITON_INTERPRET=1`` and one intra-op thread; return the JSON value its last
    stdout line holds. Fails the calling test (AssertionError with the stderr tail) when the script fails."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(test_file)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
