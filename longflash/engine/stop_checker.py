"""Detokenization and stop conditions applied after each new token (vLLM's output processor).

EOS ends a request with finish_reason "stop" (the token id is kept, the text omits it when special
tokens are skipped); a ``stop_token_ids`` hit likewise, with ``stop_reason`` = that id; a stop string
ends it with the text truncated before the match (after it with ``include_stop_str_in_output``) and
``stop_reason`` = that string; ``max_tokens`` or
``max_model_len`` end it with "length".
"""

from __future__ import annotations

from longflash.engine.sequence import Sequence


class StopChecker:
    """Args: tokenizer (HF, or None with skip_tokenizer_init), eos_token_ids, max_model_len (tokens)."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def detokenize(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.sampling_params.skip_special_tokens)

    def check(self, seq: Sequence) -> bool:
        """Update ``seq.output_text`` after appended tokens; set finish_reason when it must stop.

        Returns True when the request is finished.
        """
        params = seq.sampling_params
        token = seq.token_ids[-1]
        prev_len = len(seq.output_text)
        text = self.detokenize(seq)
        # Hold back an incomplete multi-byte character until the next token completes it.
        if text.endswith("\ufffd"):
            text = text[:-1]
        seq.output_text = text
        if params.stop and self.tokenizer is not None:
            longest = max(len(s) for s in params.stop)
            search_from = max(prev_len - longest + 1, 0)
            best = None
            for s in params.stop:
                idx = text.find(s, search_from)
                if idx != -1 and (best is None or idx < best[0]):
                    best = (idx, s)
            if best is not None:
                seq.output_text = text[:best[0] + (len(best[1]) if params.include_stop_str_in_output else 0)]
                seq.finish_reason, seq.stop_reason = "stop", best[1]
                return True
        eos = not params.ignore_eos and token in self.eos_token_ids
        if eos or token in params.stop_token_ids:
            # vLLM V1: the token that ends the request stays in the token ids, not in the text
            if self.tokenizer is not None:
                seq.output_text = self.tokenizer.decode(seq.output_token_ids[:-1],
                                                        skip_special_tokens=params.skip_special_tokens)
            seq.finish_reason, seq.stop_reason = "stop", (None if eos else token)
            return True
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False
