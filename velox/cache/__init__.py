"""The response cache: answers served again, identical requests coalesced.

`front` is the worker's cache stage (`CacheFront`), `store` the entry format and the shared
store's interface, `redis` the tier several hosts share (VELOX_REDIS_URL).
"""
