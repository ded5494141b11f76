"""The admin side of Velox: seeing inside a running gateway without slowing it down.

Supervisor side (one admin address for the whole gateway, served from its own OS thread):

* `server`: the HTTP server on VELOX_ADMIN_ADDR and its routes.
* `metrics`: the Prometheus collector (`GET /metrics`), reading shared memory only.
* `snapshot`: the JSON of `GET /stats`.
* `profiling` and `flamegraph`: `GET /debug/pprof/profile`, merging and rendering sessions.
* `control`: the supervisor's end of the control channel to each worker.
* `keystore` and `keyapi`: gateway keys made at run time (SQLite, Redis) and `/keys`.
* `keyfeed`: run-time keys' places in the shared key table, and their changes sent to the
  workers as control frames.
* `console` and `sampler`: the operator's console at `/ui` and the samples it shows.

Worker side (small and cheap to import, loaded by every worker):

* `agent`: the worker's end of the control channel (state, profile, keys).
* `accesslog`: the access log, queued on the hot path and written from the loop, never blocking.

And `doctor`, the `velox doctor` command.

Nothing here is imported by the request path itself except `agent` (from Worker.serve).
"""
