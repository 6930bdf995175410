"""Benchmarks and experiments: each measures its baseline in the same run and writes a report.

Run one from the repository root as a module, ``python -m bench.<name> --help``. Reports go to
runs/bench/ unless ``--out`` names another place; docs/results/ holds the committed record and is
written only when asked to (``--out docs/results...``). Every report carries its provenance
(``bench.record``): the command, the commit and the machine it ran on.
"""
