"""The picture of each replica's prefix cache.

``blocks`` hashes token blocks; ``shadow`` is the gateway's own guess of what a replica holds
(the shadow index); ``events`` decodes vLLM's KV cache events; ``engine_view`` builds the
engine's own picture from them (``EngineView``); ``stream`` follows one replica's event stream,
repairing gaps. No HTTP (``tests/test_layout.py``).
"""
