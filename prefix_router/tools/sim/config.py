"""Configuration of one simulated vLLM replica, with the source of every default.

Defaults model one H100 SXM 80 GB serving Llama-3.1-8B-Instruct in bf16 with vLLM's OpenAI
server defaults:

- ``block_size`` 16: vLLM's default KV block size on CUDA (``CacheConfig``).
- ``num_gpu_blocks`` 28,000: KV bytes per token are 2 (K, V) x 32 layers x 8 KV heads x 128
  head_dim x 2 bytes = 131,072 B, so a 16-token block is 2 MiB. With
  ``gpu_memory_utilization`` 0.9 of 80 GiB (77.3 GB), minus 16.1 GB of weights and about
  2 GB of activations and CUDA graphs, 59 GB remain: about 28,000 blocks (448K tokens).
- ``max_num_seqs`` 1,024 and ``max_num_batched_tokens`` 8,192: vLLM 0.32's defaults for the
  OpenAI server on a GPU of at least 70 GiB that is not an A100
  (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` in
  ``vllm/engine/arg_utils.py``).
- ``max_model_len`` 131,072: Llama-3.1's ``max_position_embeddings``.
- ``prefill_tokens_per_s`` 25,000: 2 x 8.0e9 FLOP per token against 989 TFLOP/s of dense bf16
  at 40% model FLOP utilisation, a typical figure for vLLM prefill on H100.
- ``decode_ms_per_token`` 6.0: the fixed cost of one engine step; reading 16.1 GB of weights at
  3.35 TB/s takes 4.8 ms, plus scheduling and sampling overhead (vLLM's inter-token latency for
  an 8B model at low batch on H100 is 6-7 ms).
- ``kv_read_ns_per_token`` 39: each decode step reads the KV cache of every running sequence,
  131,072 B per token at 3.35 TB/s.
- ``cpu_load_tokens_per_s`` 300,000: a block loaded back from the CPU offload tier crosses PCIe
  Gen5 x16 (64 GB/s a direction, about 40 GB/s in practice): 131,072 B a token. The tier is off
  (``cpu_offload_blocks`` 0) unless configured, as vLLM's offloading connector is.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_router.constants import MAX_DATA_PARALLEL_SIZE, VLLM_BLOCK_SIZE

__all__ = ["SimConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """One simulated replica. Times are modelled seconds unless a name says otherwise.

    Raises:
        ValueError: from ``validate`` when a field is out of range.
    """

    model: str = "meta-llama/Llama-3.1-8B-Instruct"  # served model name
    block_size: int = VLLM_BLOCK_SIZE  # tokens per KV block
    num_gpu_blocks: int = 28_000  # KV capacity in blocks, as vLLM reports it (incl. null block)
    max_num_seqs: int = 1024  # running requests at most
    max_num_batched_tokens: int = 8192  # tokens scheduled per engine step at most
    max_model_len: int = 131_072  # prompt + output tokens at most
    prefill_tokens_per_s: float = 25_000.0  # uncached prompt tokens computed per second
    decode_ms_per_token: float = 6.0  # fixed cost of every engine step, in ms
    kv_read_ns_per_token: float = 39.0  # per decode step, per token of running context, in ns
    time_scale: float = 1.0  # run this many times faster than modelled time
    default_max_tokens: int = 256  # output length when a request gives no max_tokens
    tokenizer: str | None = None  # Hugging Face tokenizer folder; None: built-in byte tokenizer
    seed: int = 0  # seeds the generated token ids
    # vLLM's --kv-events-config: {"enable_kv_cache_events": true, "publisher": "zmq",
    # "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps":
    # 10000}; None or disabled: no events (prefix_router/tools/sim/kv_events.py)
    kv_events: dict | None = None
    # vLLM's --kv-transfer-config: {"kv_connector": "NixlConnector", "kv_role": "kv_producer" |
    # "kv_consumer" | "kv_both"} for a replica of a disaggregated fleet; None: no connector
    # (prefix_router/tools/sim/kv_transfer.py)
    kv_transfer: dict | None = None
    # vLLM's --data-parallel-size: engines behind one server, each its own KV cache, scheduler and
    # event publisher (ports offset by its rank); a request's X-data-parallel-rank picks one, else
    # vLLM's balancer does (prefix_router/tools/sim/server.py)
    data_parallel_size: int = 1
    # vLLM's OffloadingConnector (CPU backend, cpu_bytes_to_use): blocks kept in CPU memory past
    # the GPU's, evicted least recently used; 0: none (prefix_router/tools/sim/offload.py)
    cpu_offload_blocks: int = 0
    cpu_load_tokens_per_s: float = 300_000.0  # tokens loaded back from the CPU tier per second

    def validate(self) -> SimConfig:
        """Return self, or raise ValueError naming the first field out of range."""
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "time_scale": self.time_scale,
            "default_max_tokens": self.default_max_tokens,
            "data_parallel_size": self.data_parallel_size,
            "cpu_load_tokens_per_s": self.cpu_load_tokens_per_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("decode_ms_per_token", "kv_read_ns_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.data_parallel_size > MAX_DATA_PARALLEL_SIZE:
            raise ValueError(f"data_parallel_size must be at most {MAX_DATA_PARALLEL_SIZE}, got {self.data_parallel_size}")
        if self.cpu_offload_blocks < 0:
            raise ValueError(f"cpu_offload_blocks must not be negative, got {self.cpu_offload_blocks}")
        if self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2, got {self.num_gpu_blocks}")
        return self

    def step_seconds(self, num_prefill_tokens: int, num_decode_context_tokens: int, num_loaded_tokens: int = 0) -> float:
        """Modelled duration of one engine step.

        ``num_prefill_tokens``: prompt tokens computed in the step (cache hits excluded).
        ``num_decode_context_tokens``: sum of the context lengths of the sequences decoding.
        ``num_loaded_tokens``: prompt tokens loaded from the CPU offload tier, counted as if the
        step waited for them (vLLM loads them while other requests run, so the model errs on the
        side of the loads costing more).
        """
        return (
            self.decode_ms_per_token * 1e-3
            + num_prefill_tokens / self.prefill_tokens_per_s
            + num_decode_context_tokens * self.kv_read_ns_per_token * 1e-9
            + num_loaded_tokens / self.cpu_load_tokens_per_s
        )
