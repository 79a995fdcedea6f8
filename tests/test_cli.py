"""`longflash generate` end to end in a subprocess."""

import subprocess
import sys


def test_generate_subprocess_token_model(tiny_model):
    path = tiny_model("qwen3-tied")
    # No tokenizer in the tiny checkpoint: a text prompt must fail with a clear message and exit 2.
    r = subprocess.run([sys.executable, "-m", "longflash.entrypoints.cli", "generate", "--model", path,
                        "--skip-tokenizer-init", "--prompt", "hello"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "needs a tokenizer" in r.stderr


def test_generate_subprocess_unknown_flag():
    r = subprocess.run([sys.executable, "-m", "longflash.entrypoints.cli", "generate", "--prompt", "x", "--bogus-flag"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "unrecognized arguments: --bogus-flag" in r.stderr


def test_bad_memory_size_names_the_format():
    """Found by a fresh user: argparse said "invalid parse_bytes value: 'lots'"."""
    r = subprocess.run([sys.executable, "-m", "longflash.entrypoints.cli", "generate", "--prompt", "x",
                        "--kv-cache-memory", "lots"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--kv-cache-memory: cannot parse memory size 'lots'; use bytes or e.g. 2GiB" in r.stderr, r.stderr
