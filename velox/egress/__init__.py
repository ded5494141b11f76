"""Egress: Velox's outbound side, which forwards API calls to the provider over pre-warmed HTTP/2.

Layers, top down: `upstream.Upstream` (one per UpstreamSpec: makes the attempts, decides
retries, picks the pool) → `h2pool.H2Pool` or `h1pool.H1Pool` (the connections of one upstream;
`pool.BasePool` holds their queue and deadline sweep) → `h2conn.H2Connection` or
`h1conn.H1Connection` (one connection, one `interfaces.UpstreamCall` per stream). The contracts
between the layers, and with the relay, are the Protocols in `interfaces`, beside the records
they pass. The HTTP/2 codec interface lives in `codec`, implemented natively (`nativecodec`)
and by its Python twin, the hand-written client framer (`framer`, VELOX_NATIVE=0). This package
module imports nothing so that loading one submodule does not pull in the others.
"""
