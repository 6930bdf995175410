"""`python -m bench.experiments NAME`: see the package docstring."""

from bench.experiments import main

main()
