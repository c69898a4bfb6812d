"""Integrations: thin adapters that map a framework's events onto a session.

The Lightning callback, the Hugging Face ``TrainerCallback`` and the pytest
plugin. They import ``session`` and ``report`` (never a detector's modules),
and each imports its framework only when it is used.
"""
