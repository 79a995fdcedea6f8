"""Prometheus metrics with vLLM's names (``vllm:*``, label ``model_name``) plus longflash's own
(``longflash:*``), served at ``GET /metrics``.

Counters mirror the engine's cumulative counters: after each step the engine thread adds the change
since the last update. Histograms observe the latencies drained from ``engine.stats`` (seconds).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
FINISHED_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """The server's collectors in their own registry.

    Args:
        model_name: value of the ``model_name`` label (the first served model name).
        num_speculative_tokens: positions of ``vllm:spec_decode_num_accepted_tokens_per_pos_total``
            to expose (0: the family exists without samples).
    """

    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        disable_created_metrics()  # as vLLM: no *_created samples
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lm = ["model_name"]
        self._lock = threading.Lock()

        def gauge(name, doc):
            return Gauge(name, doc, lm, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, lm, registry=r).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.kv_cache_free_blocks = gauge("longflash:kv_cache_free_blocks", "Free KV cache blocks in the pool.")
        self.kv_cache_total_blocks = gauge("longflash:kv_cache_total_blocks", "KV cache blocks in the pool.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          lm + ["finished_reason"], registry=r)
        self.request_success = {k: success.labels(model_name, k) for k in FINISHED_REASONS}
        self._success_family = success
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token "
                                             "in seconds.", lm, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency "
                                             "in seconds.", lm, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e_request_latency = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request "
                                             "latency in seconds.", lm, buckets=E2E_BUCKETS,
                                             registry=r).labels(model_name)
        # Speculative decoding (DFlash): drafts = verify steps, draft tokens proposed, accepted tokens.
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                          lm + ["position"], registry=r)
        self.spec_decode_num_accepted_tokens_per_pos = [per_pos.labels(model_name, str(i))
                                                        for i in range(num_speculative_tokens)]
        # Engine counter values already added to the Prometheus counters.
        self._seen: dict[str, int] = {}

    def _add(self, key: str, counter, value: int) -> None:
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = value

    def update(self, engine) -> None:
        """Called on the engine thread after each step (or batch of commands)."""
        with self._lock:
            bm = engine.block_manager
            self.num_requests_running.set(engine.num_running)
            self.num_requests_waiting.set(engine.num_waiting)
            self.kv_cache_usage_perc.set(bm.usage())
            self.kv_cache_free_blocks.set(bm.num_free_blocks)
            self.kv_cache_total_blocks.set(bm.num_blocks)
            st = engine.stats
            self._add("prompt_tokens", self.prompt_tokens, st.prompt_tokens)
            self._add("generation_tokens", self.generation_tokens, st.generation_tokens)
            self._add("num_preemptions", self.num_preemptions, st.num_preemptions)
            self._add("prefix_cache_queries", self.prefix_cache_queries, bm.prefix_cache_queries)
            self._add("prefix_cache_hits", self.prefix_cache_hits, bm.prefix_cache_hits)
            for reason, n in st.request_success.items():
                child = self.request_success.get(reason)
                if child is None:
                    child = self.request_success[reason] = self._success_family.labels(self.model_name, reason)
                self._add("success:" + reason, child, n)
            self._add("spec_drafts", self.spec_decode_num_drafts, st.spec_num_drafts)
            self._add("spec_draft_tokens", self.spec_decode_num_draft_tokens, st.spec_num_draft_tokens)
            self._add("spec_accepted", self.spec_decode_num_accepted_tokens, st.spec_num_accepted_tokens)
            for pos, child in enumerate(self.spec_decode_num_accepted_tokens_per_pos):
                self._add(f"spec_pos:{pos}", child, st.spec_accepted_per_pos.get(pos, 0))
            ttft, itl, e2e = st.drain()
            for v in ttft:
                self.time_to_first_token.observe(v)
            for v in itl:
                self.inter_token_latency.observe(v)
            for v in e2e:
                self.e2e_request_latency.observe(v)

    def count_finished(self, reason: str) -> None:
        """Requests that end outside the engine's own accounting (aborted, failed)."""
        with self._lock:
            child = self.request_success.get(reason)
            if child is None:
                child = self.request_success[reason] = self._success_family.labels(self.model_name, reason)
            child.inc()
