"""Egress: Velox's outbound side, which forwards API calls to the provider over pre-warmed HTTP/2.

The HTTP/2 codec interface lives in `codec`, with the hand-written client framer in `framer` and an
adapter over the python-hyper `h2`/`jh2` state machines in `h2lib`. This package module imports
nothing so that loading one submodule does not pull in the others.
"""
