"""Renderers: each turns a :class:`~barrierguard.Report` into one output format.

One module per format, each with ``render(report) -> str``; they import the
records of ``barrierguard.report`` and nothing else of barrierguard.
"""
