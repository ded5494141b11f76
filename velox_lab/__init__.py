"""The lab: what tests, benchmarks and the demo run Velox against, not part of the gateway.

`mock` is the mock upstream (OpenAI, Azure, Anthropic, Gemini and Bedrock shapes, HTTP/2 + TLS
or HTTP/1.1, run as its own process), `launch` starts real gateways as child processes,
`demo` is `velox demo`, `h2lib` the python-hyper h2/jh2 codec adapter kept for comparison.
Installed with the `dev` extra; nothing in `velox` imports it but `velox demo`.
"""
