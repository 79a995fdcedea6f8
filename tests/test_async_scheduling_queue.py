"""Async scheduling with a queue behind a full batch (``engine/async_scheduling.py``: steps launch ahead
while requests wait, unless a slot is free after the step), on the CPU's uniform decode path: one to
three slots for many requests of every kind (greedy that may stop by EOS, ignore_eos, sampled, stop
strings, logprobs, one-token prompts, one-token outputs), a request aborted while it waits and one
arriving late. Outputs equal the synchronous engine's, every KV block comes back, and steps really were
launched with requests waiting."""

import pytest

from longflash import SamplingParams
from longflash.engine import async_scheduling
from test_async_scheduling import PROMPTS, _engine, _run


def _requests():
    g = dict(temperature=0)
    return [("eos", PROMPTS[0], SamplingParams(**g, max_tokens=14)),
            ("ignore", PROMPTS[1], SamplingParams(**g, max_tokens=9, ignore_eos=True)),
            ("one_token_prompt", [77], SamplingParams(**g, max_tokens=7, ignore_eos=True)),
            ("stop", PROMPTS[2], SamplingParams(**g, max_tokens=30, stop=[" "])),
            ("sampled", PROMPTS[3], SamplingParams(temperature=0.9, seed=5, max_tokens=6)),
            ("one_token_output", PROMPTS[0], SamplingParams(**g, max_tokens=1)),
            ("aborted_waiting", PROMPTS[1], SamplingParams(**g, max_tokens=12)),
            ("logprobs", PROMPTS[2], SamplingParams(**g, max_tokens=5, logprobs=1)),
            ("long", [5, 6, 7], SamplingParams(**g, max_tokens=16, ignore_eos=True))]


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_queue_of_mixed_requests_behind_one_to_three_slots(max_num_seqs, monkeypatch):
    def abort_while_waiting(engine):
        assert any(s.request_id == "aborted_waiting" for s in engine.scheduler.waiting)
        assert engine.abort_request("aborted_waiting")

    def arrive(engine):
        engine.add_request("late", PROMPTS[3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))

    events = {2: abort_while_waiting, 4: arrive}
    sync = _run(_engine(False, max_num_seqs=max_num_seqs), _requests(), events)
    launch, waiting_at_launch, engines = async_scheduling.AsyncDecode.launch, [], []

    def spy(self, sched, res, rows):
        waiting_at_launch.append(len(engines[0].scheduler.waiting))
        return launch(self, sched, res, rows)

    monkeypatch.setattr(async_scheduling.AsyncDecode, "launch", spy)
    engines.append(_engine(True, max_num_seqs=max_num_seqs))
    out = _run(engines[0], _requests(), events)  # (_run checks that every block came back)
    assert out == sync
    assert "aborted_waiting" not in out and len(out["late"][0]) == 10 and len(out["long"][0]) == 16
    assert sum(w > 0 for w in waiting_at_launch) >= 5, waiting_at_launch
