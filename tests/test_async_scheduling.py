"""Async scheduling (``engine/async_scheduling.py``) on the CPU: the uniform decode path with the next step
launched before the previous one's tokens are read gives exactly the synchronous engine's outputs (greedy
stops, stop strings, length limits, sampled and logprob requests mixed in, aborts and new requests while a
step is in flight, preemption under a tiny KV pool, prefix caching), returns every KV block, and really
launches steps ahead. On the CPU the launched step runs before the host reads the previous one, so these
tests check the bookkeeping; the overlap itself is timed by ``benchmarks/e2e_decode.py`` on the GPU."""

import argparse

import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.config import EngineConfig
from longflash.default_model_path import default_model_path
from longflash.entrypoints.args import add_engine_args, engine_config_from_args

KW = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, speculative_config="off")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "To be, or not to be,", "The capital of France"]


def _engine(async_scheduling: bool, **kw):
    engine = LLM(async_scheduling=async_scheduling, **dict(KW, **kw)).engine
    engine.enable_uniform_decode(cuda_graphs=False)
    return engine


def _run(engine, requests, events=None) -> dict:
    """Add ``requests`` [(id, prompt, params)], step until done; ``events[i]`` (a function of the
    engine) runs before step i. Returns id -> (token ids, text, finish reason) of the final outputs."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final, i = {}, 0
    while engine.has_unfinished_requests() or (events and any(k >= i for k in events)):
        if events and i in events:
            events[i](engine)
        for o in engine.step():
            c = o.outputs[0]
            final[o.request_id] = (list(c.token_ids), c.text, c.finish_reason)
        i += 1
        assert i < 500
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # every block returned
    return final


def _both(requests, events=None, **kw) -> tuple[dict, dict, int]:
    sync = _run(_engine(False, **kw), requests, events)
    eng = _engine(True, **kw)
    out = _run(eng, requests, events)
    return sync, out, eng.async_decode.num_launched


def test_greedy_outputs_equal_and_steps_launch_ahead():
    greedy = [SamplingParams(temperature=0, max_tokens=n) for n in (24, 9, 31, 1)]
    reqs = [(f"r{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, greedy))]
    reqs.append(("stop", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop=["\n"])))
    reqs.append(("ids", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    sync, out, launched = _both(reqs)
    assert out == sync
    assert launched >= 15, launched  # the longest request's decode steps were launched ahead


def test_sampling_logprobs_and_min_tokens_fall_back_to_sync_steps():
    reqs = [("g", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30)),
            ("s", PROMPTS[1], SamplingParams(temperature=0.8, seed=3, max_tokens=8)),
            ("lp", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, logprobs=2)),
            ("min", PROMPTS[3], SamplingParams(temperature=0, min_tokens=12, max_tokens=14)),
            ("pen", PROMPTS[0], SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=5))]
    sync, out, launched = _both(reqs)
    assert out == sync
    assert launched > 0  # once only "g" is left


def test_abort_and_arrival_while_a_step_is_in_flight():
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:3])]

    def abort(engine):
        assert engine.abort_request("r1")

    def arrive(engine):
        engine.add_request("late", PROMPTS[3], SamplingParams(temperature=0, max_tokens=7))

    sync, out, launched = _both(reqs, {6: abort, 9: arrive})
    # r1's last output is from the step before the abort (no finish reason): the same step in both
    assert out == sync and out["r1"][2] is None and len(out["late"][0]) == 7 and len(out["r0"][0]) == 25
    assert launched > 0


def test_abort_of_every_request_drops_the_launched_step():
    engine = _engine(True)
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._ahead is not None
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.step() == [] and engine._ahead is None
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    # the same request id again: the discarded step is not mistaken for it
    final = _run(engine, [("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))])
    ref = _run(_engine(False), [("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))])
    assert final == ref


def test_waiting_requests_behind_a_full_batch(monkeypatch):
    """More requests than batch slots (max_num_seqs 2, six requests): while the batch is full, decode steps
    still launch ahead with requests waiting; a step after which a slot is free (a length finish) ends
    synchronously, so the next request is admitted at once. Greedy requests that may stop by EOS (their
    slot is taken a step later) and fixed-length ones: the synchronous engine's outputs."""
    from longflash.engine import async_scheduling
    waiting_at_launch = []
    launch = async_scheduling.AsyncDecode.launch

    def spy(self, sched, res, rows):
        waiting_at_launch.append(len(self.runner_engine.scheduler.waiting))
        return launch(self, sched, res, rows)

    kw = dict(max_num_seqs=2)
    reqs = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=i % 2 == 0))
            for i, (p, n) in enumerate(zip(PROMPTS + PROMPTS[:2], (14, 25, 6, 30, 11, 17)))]
    sync = _run(_engine(False, **kw), reqs)
    eng = _engine(True, **kw)
    eng.async_decode.runner_engine = eng
    monkeypatch.setattr(async_scheduling.AsyncDecode, "launch", spy)
    out = _run(eng, reqs)
    assert out == sync
    assert sum(w > 0 for w in waiting_at_launch) >= 10, waiting_at_launch  # launched ahead with requests waiting
    # a length finish frees a slot: no step is launched ahead of the step that admits the next request
    assert len(waiting_at_launch) < sum(len(t) for t, _, _ in out.values()) - len(out)


@pytest.mark.parametrize("kw", [dict(num_gpu_blocks=14, enable_prefix_caching=False),
                                dict(num_gpu_blocks=40, enable_prefix_caching=True),
                                dict(max_model_len=20)])
def test_preemption_prefix_caching_and_max_model_len(kw):
    # max_tokens None: up to max_model_len
    params = SamplingParams(temperature=0, max_tokens=None if "max_model_len" in kw else 30, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS)] + [("again", PROMPTS[0], params)]
    sync, out, _ = _both(reqs, **kw)
    assert out == sync
    if "max_model_len" in kw:
        assert all(r[2] == "length" for r in out.values())


def test_recompute_after_preemption_one_token_per_step():
    """A preempted request recomputes its generated tokens one per step (budget 2, two requests): those steps
    look uniform (one token past the prompt) but sample nothing; none may launch a step ahead with its argmax
    as the next input (found by a review: the outputs were corrupted)."""
    kw = dict(max_num_seqs=2, max_num_batched_tokens=2, num_gpu_blocks=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reqs = [(f"r{i}", [5 + i, 6, 7], params) for i in range(2)]
    engine = _engine(True, **kw)
    out = _run(engine, reqs)
    assert out == _run(_engine(False, **kw), reqs)
    assert engine.scheduler.num_preemptions > 0 and engine.async_decode.num_launched > 0


def test_base_exception_while_processing_a_step_does_not_skip_tokens():
    """A BaseException (KeyboardInterrupt) escaping step() while it reads step N's tokens, after N+1 was
    launched: a caller that catches it and keeps stepping must get the sync engine's tokens (the requests
    not yet processed recompute N). Async took N+1's row as N's token for them: one token dropped."""
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    reqs = [("a", "def fibonacci(n):", params), ("b", "import os\nimport sys\n", params),
            ("c", "To be, or not to be,", params)]
    outs = {}
    for a in (False, True):
        e = _engine(a, max_num_seqs=8, max_num_batched_tokens=64)
        detok, calls = e.stop_checker.detokenize, [0]

        def det(seq, detok=detok, calls=calls):
            if seq.request_id == "b":
                calls[0] += 1
                if calls[0] == 3:
                    raise KeyboardInterrupt
            return detok(seq)

        e.stop_checker.detokenize = det
        for rid, p, sp in reqs:
            e.add_request(rid, p, sp)
        final = {}
        while e.has_unfinished_requests():
            try:
                outputs = e.step()
            except KeyboardInterrupt:
                continue
            final.update({o.request_id: list(o.outputs[0].token_ids) for o in outputs})
        outs[a] = final
    assert outs[True] == outs[False]


def test_config_and_flags():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model=default_model_path(), async_scheduling="yes")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).async_scheduling is None
    assert engine_config_from_args(p.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert engine_config_from_args(p.parse_args(["--async-scheduling"])).async_scheduling is True
    # the default: off on the CPU; on with it asked for, but never with a DFlash drafter, and in effect only
    # on the uniform decode path (the GPU's; tests turn it on on the CPU)
    cpu = dict(KW, device="cpu")  # (the default device is CUDA where there is one)
    assert LLM(**cpu).engine.async_decode is None
    assert LLM(**dict(cpu, speculative_config=None), async_scheduling=True).engine.async_decode is None
    engine = LLM(**cpu, async_scheduling=True).engine
    assert engine.async_decode is not None and engine.startup_report()["async_scheduling"] is False
    engine.enable_uniform_decode(cuda_graphs=False)
    assert engine.startup_report()["async_scheduling"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("max_num_seqs", [8, 2])
def test_gpu_graphs_async_equals_sync(max_num_seqs):
    """On the GPU (CUDA graphs, async scheduling on by default): the same greedy tokens as with
    ``--no-async-scheduling``, steps launched ahead, every block returned; with 2 slots for 6 requests, also
    while requests wait behind the full batch. ignore_eos: requests end by length, so both runs have the
    same batch at every step (an EOS finish would leave its row in the launched step, changing the graph
    bucket and so the rounding of the other rows)."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 17, 33, 8, 25, 3)]
    prompts = (PROMPTS * 2)[:len(params)]
    outs, engines = {}, {}
    for a in (False, None):
        llm = LLM(async_scheduling=a, device="cuda", kv_cache_memory="1GiB", **dict(KW, max_num_seqs=max_num_seqs))
        outs[a] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        engines[a] = llm.engine
    assert outs[None] == outs[False] and [len(t) for t in outs[None]] == [40, 17, 33, 8, 25, 3]
    eng = engines[None]
    assert engines[False].async_decode is None and eng.async_decode.num_launched >= 20
    assert eng.runner.decode_runner.captured
    assert eng.block_manager.num_free_blocks == eng.num_blocks
