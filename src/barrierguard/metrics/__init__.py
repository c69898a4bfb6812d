"""Metrics: :class:`~barrierguard.MetricBuffer`, per-step metrics with no barrier.

Independent of the rest of barrierguard: imports only the leaf ``_errors``.
``buffer`` holds the public class; it composes ``spec`` (the vocabulary and its
checks), ``slots`` (per-metric state and the blocks of device rows), ``fold``
(the reductions), ``readback`` (the one transfer and the gather across ranks)
and ``state`` (the ``state_dict`` format).
"""
