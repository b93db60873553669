"""vLLM's CPU offloading with its copies done on the CPU build: loaded by a vLLM replica (never by
the tests' own process) through vLLM's extension point for offloading backends, the
``spec_name`` / ``spec_module_path`` keys of ``kv_connector_extra_config``
(``vllm/v1/kv_offload/factory.py: OffloadingSpecFactory.get_spec_cls``), with this folder on the
replica's ``PYTHONPATH``.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` (``vllm/v1/kv_offload/cpu/spec.py``) refuses a
platform that is not CUDA-alike or XPU, and its copy worker (``cpu/gpu_worker.py``) needs CUDA
streams. Everything the gateway reads stays vLLM's own: the spec subclasses the stock one, so the
offloading manager, its LRU, the ``OffloadingEventsTracker`` that publishes the tier's KV events,
the connector's lookups and its metrics are stock; only the mover is replaced, by a synchronous
copy between the KV cache (host memory on the CPU build) and a host tensor, one block a chunk.
"""

from __future__ import annotations

import time

import torch
from vllm.v1.kv_offload.base import (BlockIDsLoadStoreSpec, CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec,
                                     OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """Copies between the KV cache and a host tensor of ``num_cpu_chunks`` chunks, at once."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_cpu_chunks: int) -> None:
        if blocks_per_chunk != 1:
            raise ValueError("this test's offloading worker copies one block a chunk")
        self.caches = [t.tensor.view(torch.int8).view((-1, t.page_size_bytes)) for t in kv_caches.tensors]
        self.host = [torch.zeros((num_cpu_chunks, c.shape[1]), dtype=torch.int8) for c in self.caches]
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, src_ids, dst_ids, to_host: bool) -> bool:
        started = time.perf_counter()
        src, dst = torch.from_numpy(src_ids.astype("int64")), torch.from_numpy(dst_ids.astype("int64"))
        size = 0
        for cache, host in zip(self.caches, self.host):
            source, target = (cache, host) if to_host else (host, cache)
            target.index_copy_(0, dst, source.index_select(0, src))
            size += len(src) * cache.shape[1]
        self.done.append(TransferResult(job_id=job_id, success=True, transfer_size=size,
                                        transfer_time=time.perf_counter() - started))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return None  # every copy is done when submitted


class CPUHostOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with ``HostCopyWorker`` as its mover."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
