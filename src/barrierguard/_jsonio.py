"""Reading and writing barrierguard's JSON files, with errors that name the file."""

from __future__ import annotations

import json
import os
from typing import Any

from barrierguard._errors import BarrierGuardError

__all__ = ["read_json", "write_json"]


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON with a final newline."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def read_json(path: str | os.PathLike[str], what: str) -> tuple[str, Any]:
    """Read the JSON file at ``path``; returns its name and the data.

    Raises:
        BarrierGuardError: When the file is missing or is not JSON; the message
            names the file and says it should be a ``what`` file.

    Example:
        >>> read_json("/nonexistent.json", "report")
        Traceback (most recent call last):
        ...
        barrierguard._errors.BarrierGuardError: /nonexistent.json: no such report file
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            return name, json.load(fh)
    except FileNotFoundError as err:
        raise BarrierGuardError(f"{name}: no such {what} file") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BarrierGuardError(f"{name}: not JSON ({err})") from err
