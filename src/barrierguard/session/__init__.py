"""Session: one watching session, from ``start()`` to the report.

Owns the guard (steps, phases, policy), its options, step timing and memory
sampling. Imports ``detect`` (to install an engine and receive its syncs) and
``report`` (to build records); never an adapter, the CLI or ``metrics``.
"""
