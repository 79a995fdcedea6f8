"""One request's state through its lifecycle (nano-vllm's ``Sequence``)."""

from __future__ import annotations

import enum
import time

import torch

from longflash.engine.block_table import BlockTable
from longflash.outputs import Logprob, RequestMetrics
from longflash.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request: its tokens, how many have KV in the cache, its blocks and its sampling state.

    ``token_ids`` holds prompt + generated tokens. ``num_computed_tokens`` tokens have KV written
    (positions ``0 .. num_computed_tokens-1``). A decode step computes the last token and samples
    the next one. ``block_table`` lists physical block ids (each covering ``block_size`` tokens); it is
    a :class:`BlockTable` (a list that counts its mutations), whatever list is assigned to it.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is required")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.output_text = ""
        self.output_logprobs: list[dict[int, Logprob]] | None = [] if sampling_params.logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time(),
                                      num_prompt_tokens=len(prompt_token_ids))
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling_params.seed)
        self.num_preemptions = 0
        # Draft tokens proposed for this step's verify (speculative decoding), else empty.
        self.spec_token_ids: list[int] = []
        # Drafts computed on the device by a chained verify step for the next step:
        # (expected num_computed_tokens, expected pending token, drafts) — see LLMEngine.step.
        self.chained_drafts: tuple[int, int, list[int]] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> BlockTable:
        return self._block_table

    @block_table.setter
    def block_table(self, block_ids: list[int]) -> None:
        self._block_table = block_ids if isinstance(block_ids, BlockTable) else BlockTable(block_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV; keep generated tokens (they are re-prefilled)."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
