"""Renderers: one module per output format, each with ``render(report) -> str``."""
