"""`longflash generate` end to end in a subprocess."""

import os
import subprocess
import sys

import pytest

from longflash.entrypoints.cli import build_parser


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


def test_generate_default_max_tokens_fits_the_context():
    """`generate` without --max-tokens: its default 64 is capped at the room the prompt leaves (the
    default model, max_model_len 1100, a ~1090-token prompt): it generates to the context's end
    instead of refusing a max_tokens the user never gave; an explicit --max-tokens 64 is still refused."""
    prompt = "The quick brown fox " * 181
    base = [sys.executable, "-m", "longflash.entrypoints.cli", "generate", "--prompt", prompt, "--max-model-len", "1100"]
    r = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "finish_reason=length" in r.stderr
    r = subprocess.run(base + ["--max-tokens", "64"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "max_tokens" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x", "--max-tok", "3"],                 # was read as --max-tokens
    ["serve", "--chat-template-content", "string"],                 # was read as --chat-template-content-format
    ["serve", "--served-model", "m"],
    ["bench", "latency", "--batch", "1"],
])
def test_flag_prefixes_are_unknown_flags(argv, capsys):
    """argparse's default allow_abbrev took any unambiguous prefix of a flag (found by a fresh user:
    ``--chat-template x`` was silently ``--chat-template-content-format``); docs/serving.md says an
    unknown flag is an error, and vLLM's parser takes no prefixes either."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert f"unrecognized arguments: {argv[-2]}" in capsys.readouterr().err


def test_generate_output_ends_with_a_newline_before_the_log_line():
    """stdout and stderr into one pipe (``2>&1 | less``): the generated text ends with a newline that is
    written before the closing log line; it sat in the block-buffered stdout, so the log line was glued
    to the text (found by a fresh user)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    r = subprocess.run([sys.executable, "-m", "longflash.entrypoints.cli", "generate", "--prompt", "def add(a, b):",
                        "--max-tokens", "4", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:]
    last = r.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("INFO ") and "finish_reason=length" in last, r.stdout[-2000:]
    assert "\ndef add(a, b):" in r.stdout


def test_version_module_entry_and_subcommand_errors():
    """Found by a fresh user: no --version, no ``python -m longflash``, and an unknown flag after a
    subcommand was reported with the top-level usage (``longflash: error``)."""
    import longflash
    r = subprocess.run([sys.executable, "-m", "longflash", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"longflash {longflash.__version__}", (r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "longflash", "serve", "m", "--bogus-flag"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "longflash serve: error: unrecognized arguments: --bogus-flag" in r.stderr, r.stderr
    assert "usage: longflash serve" in r.stderr


def test_default_model_on_the_cpu_runs_one_thread_and_main_restores_the_count(monkeypatch):
    """The README's main job (embedded model, CPU, no OMP_NUM_THREADS) runs one intra-op thread; a user's
    OMP_NUM_THREADS or --model keeps PyTorch's count; main() puts the caller's count back afterwards."""
    import torch
    from longflash.entrypoints import cli
    before = torch.get_num_threads()
    seen = []
    monkeypatch.setattr(cli, "cmd_generate", lambda args: seen.append(torch.get_num_threads()) or 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        assert cli.main(["generate", "--prompt", "x", "--device", "cpu"]) == 0
        assert cli.main(["generate", "--prompt", "x", "--device", "cpu", "--model", "/some/dir"]) == 0
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert cli.main(["generate", "--prompt", "x", "--device", "cpu"]) == 0
        assert seen == [1, 2, 2]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
