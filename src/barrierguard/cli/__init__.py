"""The command line: ``barrierguard run``, ``demo`` and the CI gate commands.

An adapter like the integrations: imports ``session`` and ``report``, never a
detector's modules.
"""
