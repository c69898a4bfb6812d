"""Metrics: :class:`~barrierguard.MetricBuffer`, per-step metrics with no barrier.

Imports only the leaf ``_errors``: ``buffer`` (the public class) over ``spec``
(the vocabulary and its checks), ``slots`` (the state, the blocks of device
rows, the reductions) and ``readback`` (the one transfer, ``state_dict``).
"""
