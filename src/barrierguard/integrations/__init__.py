"""Integrations: thin adapters that map a framework's events onto a session (never a detector).

The Lightning callback, the Hugging Face ``TrainerCallback`` and the pytest plugin; each imports
its framework only when it is used.
"""
