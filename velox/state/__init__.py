"""Shared state, made by the supervisor before it forks the workers.

`stats.SharedStats` is the root: the workers' counters and histograms, and beside them the
upstreams' live state (`health`: breakers, in-flight gauges, rpm buckets, the retry budget)
and the gateway keys' limits (`keys`). Workers write their own slots; the admin reads all.
"""
