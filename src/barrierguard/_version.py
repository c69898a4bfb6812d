"""The release number, in one place (the package and every report read it)."""

__version__ = "0.1.0"
