"""Spend: what requests cost (prices), the durable usage ledger, and the reports over it.

Modules: `prices` (the price table and exact cost), `ledger` (the SQLite ledger, its writer
thread and its Redis Stream mirror), `feed` (the worker's side: rows shipped to the
supervisor's writer), `report` (totals over a period for `velox spend` and /spend), `text`
(aligned text tables for the command line).
"""
