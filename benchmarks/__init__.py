"""The benchmark suite of dcp_volumes: ``python -m benchmarks`` or ``dcp-volumes bench``.

Runs from a repository checkout (it is not in the wheel): it imports
``dcp_volumes`` and the emulator launchers of ``tests/`` from the same tree.
``benchmarks/README.md`` explains the benchmarks, their targets and figures.
"""
