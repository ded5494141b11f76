"""Routing: which upstream a request goes to, and failover.

`balance` makes the decisions (strategies, priorities, breakers, retries) over the tables and
the live state; `dispatch` turns them into upstream requests and retries them.
"""
