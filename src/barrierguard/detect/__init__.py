"""Detect: the engines that see a sync, locate it on the stack, and name its kind.

Owns the kinds of sync and their fixes, frame location, and the hub that hands
each located sync to whoever records it. Imports only barrierguard's leaf
modules (``_errors``, ``_env``): never the session, the report or an adapter.
"""
