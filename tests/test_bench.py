"""``longflash bench``: the report's metrics on known timings, the roofline bytes model on a MoE model,
and ``bench latency`` / ``bench serve`` end to end on the CPU (default model, tiny sizes)."""

import json
import subprocess
import sys

import pytest
import torch

from longflash.bench_report import RequestTiming, format_report, summarize
from longflash.bench_roofline import StepBytes, expected_distinct_experts
from longflash.bench_serve import engine_argv, spec_counters


def test_summarize_known_timings():
    t = [RequestTiming(0.0, [0.1, 0.3, 0.4], prompt_tokens=5, output_tokens=4),
         RequestTiming(0.0, [0.2, 0.6], prompt_tokens=5, output_tokens=2),
         RequestTiming(0.0, [], prompt_tokens=5, ok=False, error="boom")]
    m = summarize(t, 2.0, {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6},
                  {"bytes": 8e9, "seconds": 2.0, "steps": 4, "peak_gbs": 8.0})
    assert m["completed"] == 2 and m["failed"] == 1 and m["total_output_tokens"] == 6
    assert m["output_throughput"] == pytest.approx(3.0) and m["request_throughput"] == pytest.approx(1.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_tpot_ms"] == pytest.approx((100.0 + 400.0) / 2)  # (0.4-0.1)/3 and (0.6-0.2)/1
    assert sorted(round(x) for x in [m["mean_itl_ms"]]) == [round((200 + 100 + 400) / 3)]
    assert m["spec_decode_acceptance_length"] == pytest.approx(2.5) and m["spec_decode_acceptance_rate"] == 50.0
    assert m["achieved_bandwidth_gbs"] == pytest.approx(4.0) and m["bandwidth_roofline_fraction"] == pytest.approx(0.5)
    text = format_report(m)
    for label in ("Mean TTFT (ms):", "P99 ITL (ms):", "Acceptance length:", "Fraction of bandwidth roofline:"):
        assert label in text


def test_step_bytes_counts_chosen_experts(tiny_model):
    from longflash.models.loader import load_config
    from longflash.models.registry import get_model_class, resolve_architecture
    cfg = load_config(tiny_model("dsv3-qlora-interleave-yarn"))
    with torch.device("meta"):
        model = get_model_class(resolve_architecture(cfg))(cfg).to(torch.bfloat16)
    sb = StepBytes(model, kv_bytes_per_token=100)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    E, k, H = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    expert = 3 * H * cfg["moe_intermediate_size"] * 2
    emb = cfg["vocab_size"] * H * 2
    assert sb.weights(1) == total - moe_layers * E * expert + moe_layers * k * expert - emb + H * 2
    assert expected_distinct_experts(E, k, 1) == pytest.approx(k)
    assert sb.weights(10_000) == total  # every expert, and all vocab_size (< 10,000) embedding rows
    assert sb.step(1, 7) == sb.weights(1) + 700


def test_engine_argv_and_metrics_parsing():
    import argparse

    from longflash.entrypoints.args import add_engine_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--max-num-seqs", "4", "--no-enable-prefix-caching", "--enforce-eager",
                      "--speculative-config", "off", "--kv-cache-memory", "1GiB"])
    argv = engine_argv(a)
    assert p.parse_args(argv) == a
    text = ('vllm:spec_decode_num_drafts_total{model_name="m"} 3.0\n'
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 21.0\n'
            '# HELP x\nvllm:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0\n')
    assert spec_counters(text) == {"num_drafts": 3, "num_draft_tokens": 21, "num_accepted_tokens": 9}


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "longflash.entrypoints.cli", "bench", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_bench_latency_cpu(tmp_path):
    out = tmp_path / "lat.json"
    r = _cli("latency", "--batch-size", "2", "--input-len", "16", "--output-len", "6", "--peak-bandwidth-gbs", "10",
             "--max-num-seqs", "4", "--output-json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Latency Benchmark Result" in r.stdout and "Acceptance length:" in r.stdout
    run = json.loads(out.read_text())["runs"]["2"]["run"]
    assert run["completed"] == 2 and run["total_output_tokens"] == 12
    assert run["spec_decode_acceptance_length"] >= 1.0 and run["decode_steps"] >= 1
    assert run["bandwidth_roofline_fraction"] == pytest.approx(run["achieved_bandwidth_gbs"] / 10)


def test_bench_serve_cpu(tmp_path):
    out = tmp_path / "serve.json"
    r = _cli("serve", "--num-prompts", "3", "--input-len", "12", "--output-len", "5", "--max-concurrency", "2",
             "--max-num-seqs", "4", "--peak-bandwidth-gbs", "10", "--output-json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Serving Benchmark Result" in r.stdout
    m = json.loads(out.read_text())
    assert m["completed"] == 3 and m["failed"] == 0 and m["total_output_tokens"] == 15
    assert m["mean_ttft_ms"] > 0 and m["median_itl_ms"] > 0 and m["spec_decode_num_drafts"] >= 1
    assert 0 < m["bandwidth_roofline_fraction"] and m["roofline_estimated_from"]


def test_prompt_length_range_counts_the_output():
    from longflash.bench import make_prompts
    ok = make_prompts(None, 50, 100, 3, 84, "random", 0, output_len=16)
    assert [len(p["prompt_token_ids"]) for p in ok] == [84, 84, 84]
    with pytest.raises(ValueError, match=r"\[1, 84\].*--output-len 16"):
        make_prompts(None, 50, 100, 3, 90, "random", 0, output_len=16)


def test_mean_of_iters_pools_acceptance():
    """``bench latency --num-iters``: numeric metrics averaged over the timed batches, the acceptance
    length pooled over all drafts (not the mean of per-batch ratios)."""
    from longflash.bench import _mean_of_iters
    a = {"output_throughput": 10.0, "mean_tpot_ms": 2.0, "mean_acceptance_length": 2.0,
         "spec_decode_num_drafts": 10, "spec_decode_accepted_tokens": 10, "model": "x", "completed": 4}
    b = {"output_throughput": 30.0, "mean_tpot_ms": 4.0, "mean_acceptance_length": 4.0,
         "spec_decode_num_drafts": 31, "spec_decode_accepted_tokens": 90, "model": "x", "completed": 4}
    m = _mean_of_iters([a, b])
    assert m["completed"] == 4 and isinstance(m["completed"], int)  # a whole count prints as one
    assert m["spec_decode_num_drafts"] == 20.5
    assert m["output_throughput"] == 20.0 and m["mean_tpot_ms"] == 3.0
    assert m["mean_acceptance_length"] == pytest.approx(1 + 100 / 41) and "model" not in m
    assert [i["mean_tpot_ms"] for i in m["iters"]] == [2.0, 4.0]


@pytest.mark.parametrize("flags,message", [(("--request-rate", "-1"), "--request-rate must be > 0"),
                                           (("--max-concurrency", "0"), "--max-concurrency must be >= 1")])
def test_bench_serve_bad_rates_are_refused_before_the_server_starts(flags, message):
    """Found by a fresh user: --request-rate -1 started the server and then failed with Python's
    "sleep length must be non-negative"; --max-concurrency 0 silently meant no limit."""
    r = _cli("serve", "--num-prompts", "2", *flags)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert "started `longflash serve`" not in r.stdout


def test_bench_latency_bad_input_len_is_refused_before_the_model_loads():
    """A fresh user's --input-len 0 was refused only after the model loaded; the other sizes before."""
    r = _cli("latency", "--batch-size", "1", "--input-len", "0", "--output-len", "4")
    assert r.returncode == 2 and "--input-len must be >= 1" in r.stderr, r.stderr[-2000:]
    assert "model loaded" not in r.stderr
