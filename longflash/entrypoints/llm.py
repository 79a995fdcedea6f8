"""Offline inference API shaped like vLLM's ``LLM``."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Sequence as Seq

from tqdm.auto import tqdm

from longflash.config import EngineConfig
from longflash.default_model_path import default_model_path
from longflash.engine.llm_engine import LLMEngine
from longflash.entrypoints.chat_request import render_chat, template_options
from longflash.entrypoints.chat_utils import check_content_format
from longflash.entrypoints.parallel_sampling import child_params, child_request_ids, merge_outputs
from longflash.outputs import RequestOutput
from longflash.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | dict | list[int]


def _default_logging() -> None:
    """Show longflash's INFO logs (the start-up report: load time, KV cache size) on stderr, as vLLM's
    ``LLM`` does, when the program has not configured logging itself (no handler on the root logger
    and none on ``longflash``). ``LONGFLASH_CONFIGURE_LOGGING=0`` turns this off."""
    lg = logging.getLogger("longflash")
    if os.environ.get("LONGFLASH_CONFIGURE_LOGGING", "1") == "0" or lg.handlers or logging.getLogger().handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    lg.addHandler(h)
    if lg.level == logging.NOTSET:
        lg.setLevel(logging.INFO)
    lg.propagate = False  # a later logging.basicConfig() must not print every line twice


class LLM:
    """``LLM(model=PATH, dtype=..., skip_tokenizer_init=False, **engine_args)``.

    ``model`` defaults to the embedded default model. Engine arguments are those of
    :class:`longflash.config.EngineConfig` (vLLM's names: max_model_len, max_num_batched_tokens,
    max_num_seqs, block_size, kv_cache_memory, enable_prefix_caching, seed, ...).
    """

    def __init__(self, model: str | None = None, **kwargs):
        _default_logging()
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hints = {"gpu_memory_utilization": "the KV cache is sized by kv_cache_memory (bytes or '8GiB') or "
                                               "num_gpu_blocks, not by a fraction of the GPU",
                     "trust_remote_code": "models run on longflash's own implementations; no remote code is run"}
            raise TypeError(f"LLM() got unknown engine argument(s) {', '.join(unknown)}"
                            + "".join(f"; {k}: {hints[k]}" for k in unknown if k in hints)
                            + f". Engine arguments: {', '.join(sorted(known - {'model'}))}")
        self.engine = LLMEngine(EngineConfig(model=model or default_model_path(), **kwargs))

    def shutdown(self) -> None:
        """Stop the engine: its worker processes (a ``tensor_parallel_size`` > 1 engine; also done at
        interpreter exit). Later calls to ``generate``/``chat`` raise RuntimeError."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's ``generation_config.json`` defaults (temperature, top_p, top_k, min_p,
        repetition_penalty)."""
        gc = self.engine.generation_config
        kw = {k: gc[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gc}
        if gc.get("do_sample") is False:
            kw["temperature"] = 0.0
        return SamplingParams(**kw)

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (text, ``{"prompt_token_ids": [...]}``, or a list of ids).

        Returns one RequestOutput per prompt, in input order; a prompt whose SamplingParams has
        ``n > 1`` runs as n requests (seeds seed, seed + 1, ... when seeded) merged into one output
        with ``outputs[i].index == i`` (``parallel_sampling.py``). Raises ValueError for an invalid
        prompt or SamplingParams before anything runs (a prompt dict takes vLLM's ``prompt`` or
        ``prompt_token_ids``, not both; another key is named), TypeError when ``sampling_params`` is not
        a SamplingParams (or a list of them).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a prompt (text, token ids or {'prompt_token_ids': [...]}) or a list "
                             f"of them, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(isinstance(sp, SamplingParams)
                                                                      for sp in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                            f"{type(sampling_params).__name__}; e.g. SamplingParams(max_tokens=2), not a dict")
        if len(sampling_params) != len(prompts):
            raise ValueError("one SamplingParams per prompt is required")
        groups: list[tuple[str, list[str]]] = []  # (request id, its engine requests' ids)
        try:
            for p, sp in zip(prompts, sampling_params):
                # only the final output is read: FINAL_ONLY spares copying every output at every step (vLLM's
                # LLM.generate does the same)
                children = [dataclasses.replace(c, output_kind=RequestOutputKind.FINAL_ONLY) for c in child_params(sp)]
                rid = self.engine.new_request_id()
                groups.append((rid, []))
                for cid, cp in zip(child_request_ids(rid, len(children)), children):
                    groups[-1][1].append(self.engine.add_request(cid, p, cp))
        except Exception:
            for _, ids in groups:
                for cid in ids:
                    self.engine.abort_request(cid)
            raise
        all_ids = [cid for _, ids in groups for cid in ids]
        try:
            final, failed = self._run(all_ids, use_tqdm)
        except BaseException:  # an engine error or KeyboardInterrupt: no request of this call stays queued
            for cid in all_ids:
                self.engine.abort_request(cid)
            raise
        outputs = [None if any(c in failed for c in ids) else
                   final[ids[0]] if len(ids) == 1 else merge_outputs(rid, [final[c] for c in ids])
                   for rid, ids in groups]
        if failed:
            i, (cid, err) = next((i, (c, failed[c])) for i, (_, ids) in enumerate(groups) for c in ids if c in failed)
            e = RuntimeError(f"prompt {i} (request {cid}) failed in the engine: {err!r}; the other prompts "
                             "finished: their outputs are in this error's .outputs (None for failed prompts)")
            e.outputs = outputs
            raise e from err
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             chat_template_content_format: str = "auto", chat_template: str | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of ``{"role", "content"}`` dicts) or a list
        of them, and generate; each output's ``prompt`` is the rendered prompt text (vLLM).

        ``content``: a string, a list of text parts (``{"type": "text", "text": ...}``), or None.
        vLLM's keywords: ``chat_template``: Jinja template text used instead of the tokenizer's;
        ``chat_template_content_format``: how the template gets ``content``: ``string`` (text parts joined
        with newlines), ``openai`` (a list of text parts), or ``auto`` (detected from the template that
        renders; ``entrypoints/chat_utils.py``); ``add_generation_prompt`` / ``continue_final_message``
        (leave the last assistant message open; needs ``add_generation_prompt=False``);
        ``chat_template_kwargs``: extra template variables, merged over those two. The options are checked
        and the prompt rendered by ``entrypoints/chat_request.py``, as the server does.

        Raises ValueError (before anything runs; naming the conversation by index for a list of them) for
        an empty conversation, a bad role, a non-text part (e.g. ``image_url``), a content format outside
        auto/string/openai, a ``chat_template`` that does not parse, a refused option (a
        ``chat_template_kwargs`` key the call sets itself such as ``tokenize``, a non-bool flag, both flags
        true), ``tools`` (tool calling is not implemented), and a template that fails to render."""
        if tools:
            raise ValueError("tools is not supported: tool calling is not implemented by longflash")
        agp, kwargs = template_options(add_generation_prompt, continue_final_message, chat_template_kwargs,
                                       chat_template)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty conversation (a list of {'role', 'content'} dicts) "
                             "or a non-empty list of them")
        check_content_format(chat_template_content_format)
        batch = not isinstance(messages[0], dict)
        convs = messages if batch else [messages]
        texts, prompts = [], []
        for k, conv in enumerate(convs):
            try:
                text, ids = render_chat(self.engine.tokenizer, conv, agp, kwargs, chat_template_content_format)
            except ValueError as e:
                if batch:
                    raise ValueError(f"conversation {k}: {e}") from e
                raise
            texts.append(text)
            prompts.append({"prompt_token_ids": ids})
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> tuple[dict[str, RequestOutput], dict[str, Exception]]:
        """Step until no request is left: (final output by request id, error by request id of the
        requests the engine failed; the engine drops those and keeps serving the others)."""
        final: dict[str, RequestOutput] = {}
        failed: dict[str, Exception] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
            while self.engine.failed_requests:
                rid, err = self.engine.failed_requests.pop(0)
                failed[rid] = err
                bar.update(1)
        bar.close()
        return final, failed
