"""Offline API input checks found by a fresh-user review: SamplingParams fields of the wrong type are
refused by name (they used to reach the engine and fail there), prompts that are not text / token ids
or not valid Unicode raise ValueError, stop token ids outside the vocabulary are refused, ``--device
cuda`` without CUDA is a clear error, and a request the engine fails no longer discards the other
prompts' outputs."""

import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.config import EngineConfig
from longflash.default_model_path import default_model_path


@pytest.mark.parametrize("kw, field", [
    ({"top_k": 2.5}, "top_k"), ({"max_tokens": 5.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": True}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"max_tokens": "5"}, "max_tokens"),
    ({"seed": "a"}, "seed"), ({"seed": 2 ** 70}, "seed"), ({"stop": [1]}, "stop"), ({"stop": 3}, "stop"),
    ({"stop_token_ids": "a"}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 1.5}, "logprobs"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_sampling_params_wrong_types_are_named(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(speculative_config="off", max_num_seqs=4)


def test_bad_prompts_and_stop_ids(llm):
    sp = SamplingParams(temperature=0, max_tokens=2)
    for bad, match in (("\udcff", "not valid Unicode"), (b"\xff\xfe", "a prompt must be"), ([None], "a prompt must be"),
                       ([1.5, 2], "a prompt must be")):
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], sp)
    with pytest.raises(ValueError, match="stop_token_ids contains 1000000000, outside the vocabulary"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, stop_token_ids=[10 ** 9]))
    with pytest.raises(ValueError, match="logprobs 1000000 exceeds max_logprobs 20"):   # as vLLM's default cap
        llm.generate(["hi"], SamplingParams(max_tokens=2, logprobs=10 ** 6))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["hi"], sp)[0].outputs[0].token_ids) == 2  # still serving


def test_token_id_dict_prompts_are_checked_like_lists(llm):
    """``{"prompt_token_ids": [...]}`` refuses what the list form refuses (floats, bools, strings, None; a fresh
    user's ``[1, "2"]`` used to pass, fail in the next step and leave the LLM failing forever), by name."""
    sp = SamplingParams(temperature=0, max_tokens=2)
    for bad in ([1, 2.5], [8191.5], [1.0, 2.0], [True, 2], [1, None], [1, "2"], "12", 7):
        with pytest.raises(ValueError, match="prompt_token_ids must be a list of integer token ids"):
            llm.generate({"prompt_token_ids": bad}, sp)
    assert not llm.engine.has_unfinished_requests()
    import numpy as np
    ids = [5, 9, 17]
    want = llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": np.array(ids)}, sp)[0].outputs[0].token_ids == want  # NumPy ints
    # a key set to None counts as left out (a final fresh-user check)
    assert llm.generate({"prompt_token_ids": None, "prompt": "hi"}, sp)[0].outputs[0].token_ids == \
        llm.generate("hi", sp)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="not both"):
        llm.generate({"prompt_token_ids": ids, "prompt": "hi"}, sp)


def test_interrupted_generate_leaves_no_request_behind(llm, monkeypatch):
    """An exception out of the engine loop (here a KeyboardInterrupt at the third step) aborts every request of
    that ``generate`` call: the next call does not silently finish them first."""
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    step, calls = llm.engine.step, [0]

    def interrupted():
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return step()
    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Once"] * 3, sp)
    monkeypatch.setattr(llm.engine, "step", step)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert len(llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids) == 2


def test_chat_content_parts_and_bad_conversations(llm):
    """LLM.chat takes text parts (joined with newlines, as the server and vLLM do) and refuses what a
    text-only model cannot take by name; generate(None) is a clear error (a fresh user got a TypeError
    from inside the chat template and from len())."""
    sp = SamplingParams(temperature=0, max_tokens=4)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "Hello\nworld"}]
    assert llm.chat(parts, sp)[0].prompt_token_ids == llm.chat(joined, sp)[0].prompt_token_ids
    assert llm.chat([{"role": "user"}], sp)[0].outputs[0].token_ids  # no content: an empty message
    for bad, match in (([], "non-empty conversation"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                        "content part type 'image_url' is not supported"),
                       ([{"role": "wizard", "content": "x"}], "role must be one of")):
        with pytest.raises(ValueError, match=match):
            llm.chat(bad, sp)
    with pytest.raises(ValueError, match="prompts must be a prompt"):
        llm.generate(None, sp)
    assert not llm.engine.has_unfinished_requests()


def test_a_failed_request_keeps_the_others_outputs(llm, monkeypatch):
    engine = llm.engine
    real = engine._sample_and_verify

    def failing(seq, *a, **k):
        if seq.prompt == "boom":
            raise RuntimeError("planted failure")
        return real(seq, *a, **k)
    monkeypatch.setattr(engine, "_sample_and_verify", failing)
    sp = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(RuntimeError, match=r"prompt 1 \(request .*\) failed in the engine") as e:
        llm.generate(["good prompt", "boom", "another"], sp)
    outs = e.value.outputs
    assert outs[1] is None and [len(o.outputs[0].token_ids) for o in (outs[0], outs[2])] == [3, 3]
    assert not engine.failed_requests and not engine.has_unfinished_requests()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only torch")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        EngineConfig(model=default_model_path(), device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(model=default_model_path(), device="tpu")


def test_stop_token_text_is_not_in_the_output(llm):
    """A request ended by one of its stop_token_ids keeps the token in its ids but not in its text
    (vLLM V1; a fresh-user review found the text there)."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate(["def fibonacci(n):"], sp)[0].outputs[0]
    stop_at = full.token_ids[4]
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             stop_token_ids=[stop_at]))[0].outputs[0]
    k = full.token_ids.index(stop_at)
    assert out.token_ids == full.token_ids[:k + 1] and out.stop_reason == stop_at
    assert out.text == llm.get_tokenizer().decode(full.token_ids[:k])


def test_cumulative_logprob(llm):
    """CompletionOutput.cumulative_logprob: the sum of the sampled tokens' logprobs when logprobs are
    requested, None otherwise (vLLM's convention)."""
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    want = sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids))
    assert out.cumulative_logprob == pytest.approx(want) and out.cumulative_logprob < 0
    assert llm.generate(["def f(x):"], SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None


def test_logit_bias_offline_with_and_without_dflash():
    """logit_bias (after min_tokens, before the penalties; vLLM's order) on the offline API: greedy
    with +100 on a token emits only it, with DFlash on or off (verify positions use the biased logits);
    bad keys/values are ValueErrors naming the field."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0, 9: -50})
    on = LLM(max_num_seqs=2).generate(["def f(x):"], sp)[0].outputs[0].token_ids
    off = LLM(speculative_config="off", max_num_seqs=2).generate(["def f(x):"], sp)[0].outputs[0].token_ids
    assert on == off == [7] * 6
    for bad, match in (({-1: 1.0}, "keys"), ({3: 101}, "values"), ({3: float("nan")}, "values"), ([1], "dict")):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_prompt_tokens_are_counted_once_prefilled(llm):
    """``vllm:prompt_tokens`` counts a request's prompt when its prefill is done (as vLLM): one aborted
    while waiting adds nothing (found by a fresh user: 88,072 counted against 70,226 prefix-cache queries)."""
    e = llm.engine
    before = e.stats.prompt_tokens
    rid = e.add_request(None, {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=1))
    e.abort_request(rid)
    assert e.stats.prompt_tokens == before
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2))
    assert e.stats.prompt_tokens == before + 4


def test_prompt_dict_keys_and_sampling_params_type(llm):
    """A fresh user's ``generate({"text": "hi"})`` ran an empty-prompt error, both keys silently used the
    ids, and a dict for sampling_params was an AttributeError from inside the engine."""
    with pytest.raises(ValueError, match="unknown prompt key.*'text'.*'prompt' .*'prompt_token_ids'"):
        llm.generate({"text": "hi"})
    with pytest.raises(ValueError, match="'prompt' \\(text\\) or 'prompt_token_ids', not both"):
        llm.generate({"prompt": "hi", "prompt_token_ids": [1, 2]})
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported: the models take text only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": None}})
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate("a", {"max_tokens": 2})
    assert llm.generate({"prompt": "hi"}, SamplingParams(max_tokens=1))[0].outputs[0].token_ids


def test_output_kind_final_only_and_cumulative():
    """vLLM's ``RequestOutputKind``: a CUMULATIVE request (default) gets an output at every step that made
    tokens, a FINAL_ONLY one only when it finishes, with the same final text and ids; DELTA is refused by
    name; ``LLM.generate`` returns the same outputs as before (it asks for FINAL_ONLY internally and never
    changes the caller's params)."""
    from longflash import RequestOutputKind
    llm = LLM(max_model_len=128, num_gpu_blocks=32, speculative_config="off")
    eng = llm.engine
    seen = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        rid = eng.add_request(None, "def f(x):", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                output_kind=kind))
        outs = []
        while eng.has_unfinished_requests():
            outs += [o for o in eng.step() if o.request_id == rid]
        seen[kind] = outs
    cum, fin = seen[RequestOutputKind.CUMULATIVE], seen[RequestOutputKind.FINAL_ONLY]
    assert len(cum) == 6 and [len(o.outputs[0].token_ids) for o in cum] == [1, 2, 3, 4, 5, 6]
    assert len(fin) == 1 and fin[0].finished
    assert fin[0].outputs[0].token_ids == cum[-1].outputs[0].token_ids and fin[0].outputs[0].text == cum[-1].outputs[0].text
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert llm.generate(["def f(x):"], sp)[0].outputs[0].token_ids == cum[-1].outputs[0].token_ids
    assert sp.output_kind == RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="DELTA is not supported"):
        eng.add_request(None, "x", SamplingParams(output_kind=RequestOutputKind.DELTA))


def test_without_chunked_prefill_a_derived_max_model_len_fits_the_step_budget():
    """Chunked prefill off and max_model_len left to the engine: max_model_len is lowered to
    max_num_batched_tokens, so a longer prompt is refused by name (it used to wait forever: the scheduler never
    fit it into a step; found by a fresh-user review)."""
    llm = LLM(enable_chunked_prefill=False, max_num_batched_tokens=64, speculative_config="off",
              kv_cache_memory="16MiB")
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=2))
    out = llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    llm.shutdown()


def test_fp16_model_with_its_drafter():
    """``dtype=float16`` with the default model's DFlash drafter: the drafter's KV pool is fp16 too (it was
    bf16 and the first draft failed with a dtype mismatch; found by a fresh-user review); greedy tokens equal
    those without speculative decoding."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for spec in (None, "off"):
        llm = LLM(dtype="float16", max_num_seqs=2, speculative_config=spec, kv_cache_memory="64MiB")
        outs.append([o.outputs[0].token_ids for o in llm.generate(["def fibonacci(n):", "import os"], sp)])
        if spec is None:
            assert llm.engine.proposer.pool_dtype == torch.float16
        llm.shutdown()
    assert outs[0] == outs[1]
