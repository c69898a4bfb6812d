"""Integrations: thin adapters that map a framework's events onto a session (never a detector);
each imports its framework only when used."""
