"""Shared by the tests that compile Triton kernels for sm_90 without a GPU (Triton's bundled ptxas): run
the test file itself with ``--compile-sm90`` in a subprocess without ``TRITON_INTERPRET`` (the flag
must not be set when Triton is imported) and return the JSON dict it prints last."""

import json
import os
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_report(test_file: str, timeout_s: int = 300) -> dict:
    """The ``--compile-sm90`` report of ``test_file`` (skips the test when Triton or its ptxas is
    missing; fails it with the subprocess's stderr when the script fails)."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")):
        pytest.skip("Triton's bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, test_file, "--compile-sm90"], env=env, capture_output=True, text=True,
                       timeout=timeout_s)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def ptxas_usage(ptx: str) -> dict:
    """{"regs", "spill_bytes"} of ``ptx`` by Triton's bundled ptxas for sm_90a (``-v``), for the compile tests'
    register and spill checks (a CompiledKernel reports them only once loaded on a GPU)."""
    import re
    import tempfile

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                              text=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"regs": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else None}
