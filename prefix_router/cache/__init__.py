"""The picture of each replica's prefix cache.

``blocks`` hashes token blocks; ``shadow`` is the gateway's own guess of what a replica holds
(the shadow index), kept for the whole fleet in one radix tree (``tree``); ``events`` decodes
vLLM's KV cache events; ``engine_view`` builds the engine's own picture from them
(``EngineView``, taking them a run at a time: ``intake``), kept for the whole fleet in one map
(``engine_map``, on the numpy tables of ``id_table`` and ``u64map``; removed blocks in a
``ghosts`` ring); ``holders`` walks a prompt once for every replica; ``stream`` follows one
replica's event stream, repairing gaps. No HTTP (``tests/test_layout.py``).
"""
