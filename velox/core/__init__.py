"""The leaves every part of Velox shares; nothing here imports the rest of velox.

`types` (the request, its route and the responder protocol), `errors` (every error the gateway
answers itself, and the one mapping to the OpenAI error shape), `clock` (the one monotonic
clock) and `fields` (the shared-memory field numbers and the status-class table).
"""
