"""Miss accounting: why a request did not hit the cache.

``classify`` names each request's result (hit, or a miss that was cold, changed, routed or
evicted) from the conversation's memory; ``diagnosis`` names why a client changed its prefix,
from fingerprints of two requests; ``change_sites`` records where clients change them
(``GET /debug/changes``); ``request_log`` writes one line per finished request.
"""
