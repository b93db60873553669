"""The HTTP layer: one client request from arrival to answer.

``proxy`` runs a generating request through its stages: ``inbound`` (read and check the body,
``bodies``; sort the path by ``prefix_router.endpoints``), the routing choice, ``forward`` (send, retry, fail
over), ``relay`` (stream the answer back, read its usage) and ``learning`` (what the answer
teaches the cache picture and the miss accounting). ``passthrough`` serves the rest of vLLM's API.
"""
