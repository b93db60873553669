"""The simulated replica's Prometheus metrics (``prefix_router/tools/sim/metrics.py``): vLLM's
names and labels, and prefix cache counters that match the usage the client saw."""

from __future__ import annotations

from .test_server import CONFIG, MODEL, client, complete, metric_samples, prompt_ids  # noqa: F401 (a fixture)


async def test_prefix_cache_counters_match_the_usage_the_client_saw(client):
    prompts = [prompt_ids(40), prompt_ids(40), prompt_ids(70), prompt_ids(33, start=9000)]
    sent = cached = 0
    for prompt in prompts:
        _, body = await complete(client, prompt=prompt, max_tokens=2)
        sent += body["usage"]["prompt_tokens"]
        cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    samples = await metric_samples(client)
    assert samples["vllm:prefix_cache_queries_total"][0].value == sent
    assert samples["vllm:prefix_cache_hits_total"][0].value == cached


async def test_metrics_carry_vllm_names_and_labels(client):
    await complete(client, prompt=prompt_ids(30), max_tokens=3)
    samples = await metric_samples(client)
    (info,) = samples["vllm:cache_config_info"]
    assert info.labels["block_size"] == str(CONFIG.block_size)
    assert info.labels["num_gpu_blocks"] == str(CONFIG.num_gpu_blocks)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        (sample,) = samples[name]
        assert sample.labels == {"model_name": MODEL, "engine": "0"}, name
    assert samples["vllm:time_to_first_token_seconds_count"][0].value == 1
    assert samples["vllm:e2e_request_latency_seconds_count"][0].value == 1
    assert samples["vllm:num_requests_running"][0].value == 0
    assert samples["vllm:kv_cache_usage_perc"][0].value == 0
