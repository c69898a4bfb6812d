"""The engine that detects nothing: used when no detection can run here."""

from __future__ import annotations

__all__ = ["NoneEngine"]


class NoneEngine:
    """Installs nothing. The guard still counts steps and says that no detection ran."""

    name = "none"

    def install(self) -> None:
        pass

    def uninstall(self) -> None:
        pass
