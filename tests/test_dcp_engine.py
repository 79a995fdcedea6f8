"""DCP wired into LLMEngine (``tensor_parallel_size == decode_context_parallel_size``: weights sharded
over the ranks, CPU, gloo): logits (score, chunked, prefix hits) and 64 greedy tokens equal the
single-process engine for the tiny DeepSeek-V3 (the default model: ``test_tp.py``); a killed worker
makes the engine raise within 60 s."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch

from longflash.config import EngineConfig
from longflash.engine.llm_engine import LLMEngine
from longflash.sampling_params import SamplingParams

from engine_helpers import greedy_tokens


def _engine(model, dcp, **kw):
    args = dict(model=model, block_size=4, num_gpu_blocks=128, max_num_batched_tokens=16, context_workspace_rows=4,
                skip_tokenizer_init=True, tensor_parallel_size=dcp, decode_context_parallel_size=dcp,
                speculative_config="off", distributed_timeout_s=30)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def _generate(engine, prompts, max_tokens):
    return greedy_tokens(engine, prompts, max_tokens)


def _run(model, dcp, prompts, max_tokens, **kw):
    eng = _engine(model, dcp, **kw)
    try:
        logits = [eng.score(p, chunk_size=12) for p in prompts]
        # prefix-cache hit of 48 tokens for every dcp in {1, 2, 4} (logical blocks of 4, 8, 16): with
        # an fp8 cache the hit length changes which rows are read back quantized, so it must match.
        logits.append(eng.score(prompts[0][:49], chunk_size=12))
        assert eng.block_manager.prefix_cache_hits >= 48
        tokens = _generate(eng, prompts, max_tokens)
        report = eng.startup_report()
    finally:
        eng.shutdown()
    return logits, tokens, report


# (tests/test_dcp_model.py covers dcp 4 at the runner level; 4 ranks on 2 CPU cores are slow here;
# tests/test_tp.py runs the default model under -tp 2 -dcp 1/2, with its tolerance for that model)
@pytest.mark.parametrize("variant,dcp,kw", [
    ("tiny", 2, {}),
    ("tiny", 2, {"kv_cache_dtype": "fp8", "cp_kv_cache_interleave_size": 4}),
])
def test_engine_dcp_equals_single_process(tiny_model, variant, dcp, kw):
    model = tiny_model("dsv3-qlora-interleave-yarn")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 200, (57,), generator=g).tolist(), [5, 6, 7], [9]]
    ref_logits, ref_tokens, ref_rep = _run(model, 1, prompts, 64, **kw)
    logits, tokens, rep = _run(model, dcp, prompts, 64, **kw)
    assert tokens == ref_tokens and all(len(t) == 64 for t in tokens)
    for a, b in zip(logits, ref_logits):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5
    assert rep["kv_cache_tokens"] == dcp * ref_rep["kv_cache_tokens"]      # capacity grows x dcp
    assert rep["kv_cache_bytes"] == ref_rep["kv_cache_bytes"]              # per rank: the same pool


def test_unwired_combinations_still_refused():
    # (CUDA devices are wired now: their start-up checks are in test_dcp_nccl.py)
    with pytest.raises(ValueError):
        EngineConfig(model="x", tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4,
                     cp_kv_cache_interleave_size=3)


def test_idle_past_timeout_then_killed_worker_makes_engine_raise_within_60s(tiny_model):
    """Idle longer than the collective timeout: the workers wait on the store, not in a collective,
    so the engine still works. Then SIGKILL a worker: step() raises within 60 s (never hangs)."""
    eng = _engine(tiny_model("dsv3-qlora-interleave-yarn"), 2, distributed_timeout_s=2)
    try:
        eng.add_request(None, list(range(2, 40)), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        for _ in range(3):
            eng.step()
        time.sleep(3)                                    # idle > distributed_timeout_s
        for _ in range(3):
            eng.step()
        assert all(p.exitcode is None for p in eng.runner.procs)
        os.kill(eng.runner.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception) as ei:
            while time.monotonic() - t0 < 60:
                eng.step()
        assert time.monotonic() - t0 < 60
        assert "rank 1" in str(ei.value) or "Connection" in str(ei.value) or "closed" in str(ei.value).lower()
    finally:
        eng.shutdown()


def test_one_process_engine_beside_a_dcp_engine(tiny_model):
    """A one-process engine and a -dcp 2 engine alive in the same process: each forward reads its own
    runner's parallel state (``ForwardContext.parallel``), so the one-process engine keeps its answers
    (it used to pick up the DCP group and wait on a collective nobody else joined)."""
    model = tiny_model("dsv3-qlora-interleave-yarn")
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    one = _engine(model, 1)
    want = greedy_tokens(one, prompts, 12)
    dcp = _engine(model, 2, distributed_timeout_s=10)
    try:
        assert greedy_tokens(one, prompts, 12) == want
        assert greedy_tokens(dcp, prompts, 12) == want
    finally:
        dcp.shutdown()
        one.shutdown()


def test_worker_dying_at_start_up_fails_the_start_at_once(tmp_path):
    """A script that builds a -tp 2 engine without a ``__main__`` guard: the worker (forkserver/spawn
    re-imports the script) dies on start-up; the engine fails in seconds naming the rank and the guard,
    instead of waiting the whole rendezvous timeout (it used to say only "1/2 clients joined" after 60 s)."""
    import subprocess
    import sys
    script = tmp_path / "no_guard.py"
    script.write_text("from longflash import LLM\nLLM(tensor_parallel_size=2, distributed_timeout_s=60)\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1"))
    assert r.returncode != 0
    assert "worker rank 1 exited during start-up" in r.stderr and "__main__" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 45


def test_script_that_never_shuts_down_stops_its_workers_cleanly(tmp_path):
    """A -tp 2 script that exits without ``shutdown()``: the engine's exit hook sends the workers the
    stop message, so they exit by themselves and leave no semaphores (before, multiprocessing's exit
    hook SIGTERMed them: "resource_tracker: There appear to be 1 leaked semaphore objects"; found by a
    fresh user)."""
    import subprocess
    import sys
    script = tmp_path / "no_shutdown.py"
    script.write_text("from longflash import LLM, SamplingParams\n"
                      "if __name__ == '__main__':\n"
                      "    llm = LLM(tensor_parallel_size=2, distributed_timeout_s=60)\n"
                      "    out = llm.generate(['def add(a, b):'], SamplingParams(max_tokens=4, temperature=0))\n"
                      "    print('tokens', len(out[0].outputs[0].token_ids))\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokens 4" in r.stdout
    assert "leaked" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_llm_shutdown_then_generate_says_the_engine_was_shut_down(tiny_model):
    """``LLM.shutdown()`` (vLLM users reach for it; it was missing) stops the workers, is idempotent,
    and a later generate names the cause (it used to say "DCP worker rank 1 exited (code 0)")."""
    from longflash import LLM
    llm = LLM(tiny_model("dsv3-qlora-interleave-yarn"), block_size=4, num_gpu_blocks=128, skip_tokenizer_init=True,
              tensor_parallel_size=2, speculative_config="off", distributed_timeout_s=30)
    params = SamplingParams(temperature=0, max_tokens=3)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    one = LLM(tiny_model("dsv3-qlora-interleave-yarn"), block_size=4, num_gpu_blocks=128, skip_tokenizer_init=True,
              speculative_config="off")
    one.shutdown()   # one process: the same contract
    with pytest.raises(RuntimeError, match="shut down"):
        one.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)


def test_llm_unknown_engine_argument_names_it():
    from longflash import LLM
    with pytest.raises(TypeError, match="unknown engine argument.*gpu_memory_utilization.*kv_cache_memory"):
        LLM(gpu_memory_utilization=0.5)


def _start_script(path, source: str):
    """Write ``source`` to ``path`` and start it with this Python in its own session (a process group to signal),
    the repository on PYTHONPATH, one OpenMP thread, stdout and stderr together in a text pipe."""
    import subprocess
    import sys
    path.write_text(source)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1"), start_new_session=True)


def test_ctrl_c_in_the_middle_of_a_step_exits_promptly(tmp_path):
    """Ctrl-C (SIGINT to the process group) while a -tp 2 script generates: the workers ignore it and
    wait in a collective rank 0 left; rank 0's exit hook sees the interrupted step and kills them at
    once instead of posting a stop message they cannot read (that took 11 s: a 5 s post deadline,
    then a 10 s join), and nothing is left running."""
    p = _start_script(tmp_path / "interrupted.py", "from longflash import LLM, SamplingParams\n"
                      "if __name__ == '__main__':\n"
                      "    llm = LLM(tensor_parallel_size=2, distributed_timeout_s=60)\n"
                      "    print('READY', flush=True)\n"
                      "    llm.generate(['def f(x):'] * 4, SamplingParams(max_tokens=5000, ignore_eos=True), "
                      "use_tqdm=False)\n")
    try:
        for line in p.stdout:
            if "READY" in line:
                break
        time.sleep(2.0)
        group = subprocess.run(["pgrep", "-g", str(p.pid)], capture_output=True, text=True).stdout.split()
        os.killpg(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 8
        assert "leaked semaphore" not in out, out[-2000:]   # the killed worker held none
        time.sleep(0.5)
        alive = [x for x in group if os.path.exists(f"/proc/{x}") and open(f"/proc/{x}/stat").read().split()[2] != "Z"]
        assert not alive, alive
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_killed_rank_0_stops_its_workers_with_one_clear_line(tmp_path):
    """SIGKILL of rank 0 between steps (the workers wait for the next step): each worker stops with one line
    naming rank 0, not with c10d's TCPStore warning and C++ stack trace (the store's host is rank 0; a local
    worker checks its parent first), and no worker outlives it."""
    p = _start_script(tmp_path / "killed.py", "import os, signal\n"
                      "from longflash import LLM, SamplingParams\n"
                      "if __name__ == '__main__':\n"
                      "    llm = LLM(tensor_parallel_size=2, max_num_seqs=2, kv_cache_memory='64MiB')\n"
                      "    llm.generate(['def f(x):'], SamplingParams(max_tokens=3), use_tqdm=False)\n"
                      "    print('PID', os.getpid(), flush=True)\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n")
    try:
        out, _ = p.communicate(timeout=240)   # the pipe closes when the workers (which share it) are gone too
        assert p.returncode == -signal.SIGKILL, out[-3000:]
        pid = out.split("PID ")[1].split()[0]
        assert f"TP/DCP worker rank 1: rank 0 (pid {pid}) exited; stopping" in out, out[-3000:]
        assert "TCPStore" not in out and "Failed to recv" not in out, out[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
