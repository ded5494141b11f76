"""Ingress: the client edge of a worker.

`connection` is the HTTP/1.1 server (one `ClientConnection` per client, `IngressState` per
worker); `classify` decides at header time what a request is (its `Kind`) and refuses what is
not served; `auth` checks the gateway keys and decides what of the client's head goes
upstream; `h1write` builds the response bytes; `arena` holds request bodies and `ring` carries
complete requests to the worker's drain.
"""
