"""Session: one watching session, from ``start()`` to the report: the guard (steps,
phases, policy), its options, step timing and memory sampling. Imports ``detect`` and
``report``; never an adapter, the CLI or ``metrics``.
"""
