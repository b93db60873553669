"""Constants that the gateway and the tools beside it share, each defined once, with its source.

Configuration defaults stay with their fields (``config/schema.py``); what is here is what more
than one module must agree on.
"""

from __future__ import annotations

__all__ = ["DP_RANK_HEADER", "MAX_DATA_PARALLEL_SIZE", "DP_SIZE_ANNOTATION", "KV_EVENTS_PORT_ANNOTATION",
           "KV_EVENTS_REPLAY_PORT_ANNOTATION", "REPLICA_HEADER", "VLLM_BLOCK_SIZE", "CHAR_BLOCK_SIZE", "VLLM_TTFT_BUCKETS", "VLLM_LATENCY_BUCKETS",
           "TOKENIZER_CACHE_TOKENS"]

# The response header naming the replica that served a proxied request (the replay client,
# the demo and the tests read it)
REPLICA_HEADER = "x-prefix-router-replica"
# the header that sends a request to one data-parallel rank of a vLLM server, past its own balancer
# (vllm/entrypoints/generate/base/serving.py, vLLM 0.32)
DP_RANK_HEADER = "X-data-parallel-rank"
# the most data-parallel ranks one server may be given (replicas[].data_parallel_size, a pod's
# annotation): each is a replica with its own index, so a typo must not make a million of them;
# vLLM reaches by header only the engines local to the server (vllm/v1/engine/input_processor.py),
# 8 a node in practice
MAX_DATA_PARALLEL_SIZE = 256

# pod annotations that discovery.kubernetes reads (prefix_router/fleet/kubernetes.py): the
# server's --data-parallel-size (absent: 1, vLLM balancing its ranks itself), and the port of its
# KV-event publisher and replay socket, for vLLM before 0.32, which has no /kv_event_sources
DP_SIZE_ANNOTATION = "prefix-router.io/data-parallel-size"
KV_EVENTS_PORT_ANNOTATION = "prefix-router.io/kv-events-port"
KV_EVENTS_REPLAY_PORT_ANNOTATION = "prefix-router.io/kv-events-replay-port"

# vLLM's default KV block size on GPU (``CacheConfig.block_size``, vllm/config/cache.py): the
# gateway's, the simulator's and the audit's when nothing says otherwise
VLLM_BLOCK_SIZE = 16

# Characters per block when the gateway has no tokenizer (``routing.char_block_size``'s
# default): about 16 tokens of English at 4 characters a token
CHAR_BLOCK_SIZE = 64

# Token ids of rendered prompts the tokenizer keeps to tokenize a conversation's next turn
# incrementally (``index.tokenizer_cache_tokens``' default, ``HFTokenizer``'s too): 16 million,
# about 170 MB at 10.5 bytes a token: enough that 256 conversations of 32k tokens in flight find
# their prefix on the next turn, where a quarter of it let every one go (docs/performance-notes.md)
TOKENIZER_CACHE_TOKENS = 16_000_000

# vllm/v1/metrics/loggers.py (0.32), PrometheusStatLogger's histogram buckets in seconds: the
# gateway's TTFT and request-duration histograms use them too, so both sides line up on a dashboard
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
