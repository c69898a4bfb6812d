"""Detect: the engines that see a sync, locate it on the stack, and name its kind.

It imports only barrierguard's leaf modules (``_errors``, ``_env``): never the
session, the report or an adapter.
"""
