"""Admission: the stages that decide whether a request goes on at all.

`parse` validates the body and reads the model (400s), `keys` applies the caller's `[[key]]`
(403, its own 429s), `ratelimit` is the gateway's global token bucket (429).
"""
