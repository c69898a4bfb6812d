"""Metrics: :class:`~barrierguard.MetricBuffer` (``buffer``) over ``spec`` (its vocabulary),
``slots`` (the state and the reductions) and ``readback`` (``compute()``, ``state_dict``).
"""
