"""Configuration: the `VELOX_*` settings (`settings`: the FIELDS table, `Settings`, `load`) and
the TOML tables of upstreams, routes, keys and policies (`tables`).
"""
