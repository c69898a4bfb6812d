"""The command line: ``barrierguard run``, ``demo`` and the CI gate commands."""
