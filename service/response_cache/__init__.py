"""The response cache (docs/response_cache.md; Triton's `src/cache_manager`): a repeated request answered from a
cache of whole answers, keyed by a hash of everything that decides the answer; the serving layer
(`service.serving.cached`) uses it, so every API does.

- cache.py: `ResponseCache` (the store, which models it is on for) and `VersionCache` (one loaded version's view)
- keys.py: the canonical serialisation and the hash; codec.py: an answer as bytes and back
- local.py: the in-process store, least recently used within a bound in bytes; redis_store.py: the shared one
"""
