"""Synthetic data and scripted broker peers, for tests and benchmarks: no model needed.

``segments`` builds valid segments and weights; ``peers`` runs the real broker in its own process
and talks to it through ``common.transport.Client`` as the roles do. Only ``common`` is imported,
so a benchmark measures the same wire the roles use.
"""
