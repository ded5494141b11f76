"""The relay: the upstream's answer carried back to the client (`exchange.Exchange`), and
the token accounting of what passes (`usage`).
"""
