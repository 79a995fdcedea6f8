"""``n`` completions of one prompt as n engine requests (vLLM V1's parallel sampling).

The engine runs requests with ``n == 1``; ``LLM.generate`` and the server fan a request with
``n > 1`` out into n child requests and merge their outputs into one ``RequestOutput`` whose
``outputs[i].index == i``. The children share the prompt, so with prefix caching its full KV blocks
are computed once.
"""

from __future__ import annotations

import dataclasses

from longflash.outputs import RequestOutput
from longflash.sampling_params import SamplingParams

_SEED_END = 2 ** 64  # torch.Generator.manual_seed accepts [-2**63, 2**64)


def child_request_ids(request_id: str, n: int) -> list[str]:
    """``[request_id]`` for n == 1, else ``["0_<id>", "1_<id>", ...]`` (vLLM's child ids)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The n children's SamplingParams: ``params`` itself when n == 1, else copies with n = 1 and
    seed ``seed + i`` (wrapped below 2**64) when a seed is given, as vLLM's ``ParentRequest`` does;
    unseeded children draw from the engine's generator, so they differ.
    Raises ValueError (from ``SamplingParams.validate``) for invalid params."""
    params.validate()
    if params.n == 1:
        return [params]
    out = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None:
            seed = seed + i - _SEED_END if seed + i >= _SEED_END else seed + i
        out.append(dataclasses.replace(params, n=1, seed=seed, stop=list(params.stop),
                                       stop_token_ids=list(params.stop_token_ids)))
    return out


def merge_outputs(request_id: str, children: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput with the children's completions, ``outputs[i].index = i``.

    ``finished`` when every child is; ``metrics`` and ``num_cached_tokens`` are those of child 0
    (each child is its own engine request with its own timings). Raises ValueError for no children.
    """
    if not children:
        raise ValueError("merge_outputs needs at least one child output")
    first = children[0]
    comps = [dataclasses.replace(c.outputs[0], index=i) for i, c in enumerate(children)]
    return RequestOutput(request_id, first.prompt, list(first.prompt_token_ids), comps,
                         all(c.finished for c in children), first.metrics, first.num_cached_tokens)
