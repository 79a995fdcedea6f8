"""``LLM(...)`` shows the engine's INFO start-up report on stderr when the program has not configured
logging (as vLLM's ``LLM`` does; a fresh user saw nothing offline while the CLI printed it), not when it
has, and not with ``LONGFLASH_CONFIGURE_LOGGING=0``; a later ``logging.basicConfig`` does not double it."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = ("import logging, sys\n"
          "if sys.argv[1] == 'configured': logging.basicConfig(level=logging.WARNING)\n"
          "from longflash import LLM\n"
          "llm = LLM(speculative_config='off', num_gpu_blocks=64)\n"
          "logging.basicConfig(level=logging.INFO)\n"
          "logging.getLogger('longflash').info('after basicConfig')\n")


@pytest.mark.parametrize("mode,env,shown", [("plain", {}, True), ("plain", {"LONGFLASH_CONFIGURE_LOGGING": "0"}, False),
                                            ("configured", {}, False)])
def test_llm_start_up_report_on_stderr(mode, env, shown):
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if k != "LONGFLASH_CONFIGURE_LOGGING"},
                            "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **env})
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("KV cache:" in r.stderr) == shown, r.stderr[-2000:]
    if shown:
        assert r.stderr.count("after basicConfig") == 1, r.stderr[-2000:]
