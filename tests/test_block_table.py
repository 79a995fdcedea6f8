"""``BlockTable`` counts its mutations so the uniform decode step converts a request's block table to numpy
only when it changed; a Sequence wraps any list assigned to it; streamed RequestOutputs share the prompt's
ids instead of copying them every step (both were O(context) host work per decode step)."""

import pickle

import numpy as np
import pytest

from longflash.engine.block_table import BlockTable
from longflash.engine.sequence import Sequence
from longflash.sampling_params import SamplingParams


def test_every_mutation_is_counted_and_the_array_follows():
    t = BlockTable([3, 1])
    a = t.as_array()
    assert a.dtype == np.int32 and a.tolist() == [3, 1] and t.as_array() is a  # cached while unchanged
    ops = [lambda: t.append(7), lambda: t.extend([8, 9]), lambda: t.insert(0, 5), lambda: t.pop(),
           lambda: t.remove(5), lambda: t.__setitem__(0, 4), lambda: t.__delitem__(0), lambda: t.sort(),
           lambda: t.reverse(), lambda: t.__iadd__([2]), lambda: t.__imul__(1), lambda: t.clear()]
    for op in ops:
        v = t.version
        op()
        assert t.version == v + 1
        assert t.as_array().tolist() == list(t)
    t += [6]  # the in-place operators keep the object
    assert isinstance(t, BlockTable) and t.as_array().tolist() == [6]
    def stops_midway():
        yield 11
        raise RuntimeError("stop")
    try:
        t.extend(stops_midway())  # the item it got is kept: counted too
    except RuntimeError:
        pass
    assert t.as_array().tolist() == [6, 11] == list(t)
    with pytest.raises(ValueError):
        t.as_array()[0] = 0  # the shared copy is read-only
    t.pop()
    u = pickle.loads(pickle.dumps(t))
    assert isinstance(u, BlockTable) and list(u) == [6] and u.as_array().tolist() == [6]


def test_sequence_wraps_assigned_lists():
    s = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=2))
    assert isinstance(s.block_table, BlockTable) and s.block_table == []
    s.block_table = [4, 5]
    assert isinstance(s.block_table, BlockTable) and s.block_table.as_array().tolist() == [4, 5]
    s.block_table.append(6)
    assert s.block_table.as_array().tolist() == [4, 5, 6]
    s.reset_for_recompute()
    assert isinstance(s.block_table, BlockTable) and s.block_table == []


def test_streamed_outputs_share_the_prompt_ids(tiny_model):
    from longflash.config import EngineConfig
    from longflash.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=tiny_model("dsv3-qlora-interleave-yarn"), dtype="float32", device="cpu",
                                    block_size=4, num_gpu_blocks=64, skip_tokenizer_init=True))
    prompt = list(range(5, 25))
    engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_token_ids for o in engine.step()]
    assert len(seen) >= 2 and all(p == prompt for p in seen)
    assert all(p is seen[0] for p in seen)  # one list for every step's output, not a copy per step
