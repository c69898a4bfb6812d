"""Renderers: each turns a :class:`~barrierguard.Report` into one output format."""
