"""The picture of each replica's prefix cache.

``blocks`` hashes token blocks; ``index`` is the gateway's own guess of what a replica holds
(the shadow index); ``events`` decodes vLLM's KV cache events and builds the engine's own
picture (``EngineView``); ``stream`` follows one replica's event stream. No HTTP
(``tests/test_layout.py``).
"""
