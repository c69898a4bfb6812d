"""Metrics: :class:`~barrierguard.MetricBuffer` (``buffer``) over its state (``slots``)."""
