"""Reading and writing barrierguard's JSON files, with errors that name the file."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from typing import Any

from barrierguard._errors import BarrierGuardError

__all__ = ["check_schema", "read_json", "write_json", "write_text"]


@functools.cache
def _umask() -> int:
    # The only way to read the umask is to set it: once per process, put back at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON with a final newline, atomically."""
    write_text(path, json.dumps(data, indent=2) + "\n")


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a reader,
    or a job killed meanwhile, sees the old file or the new one, never half."""
    name = _target(os.fspath(path))
    folder = os.path.dirname(os.path.abspath(name))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(name)}.", suffix=".tmp", dir=folder)
    except OSError as err:  # name the file asked for, not the temporary one
        raise type(err)(err.errno, err.strerror, name) from err
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        # mkstemp makes the file private (0600); give it what open() would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _target(name: str) -> str:
    """The regular file that ``name`` writes (a symbolic link is written through); an
    OSError for anything else (a directory, ``/dev/null``), which a replace would swap."""
    target = os.path.realpath(name) if os.path.islink(name) else name
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    if not stat.S_ISREG(mode):
        raise OSError(
            errno.EINVAL,
            "not a regular file (a report replaces its file atomically; name a file path)",
            name,
        )
    return target


def read_json(path: str | os.PathLike[str], what: str) -> tuple[str, Any]:
    """Read the JSON file at ``path``; returns its name and the data.

    Raises:
        BarrierGuardError: When the file is missing or is not JSON; the message
            names the file and says it should be a ``what`` file.
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            return name, json.load(fh)
    except FileNotFoundError as err:
        raise BarrierGuardError(f"{name}: no such {what} file") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BarrierGuardError(f"{name}: not JSON ({err})") from err


def check_schema(data: Any, source: str, schema: str, what: str = "", hint: str = "") -> None:
    """Raise a :class:`BarrierGuardError` that starts with ``source`` unless ``data`` is
    a JSON object of ``schema`` (``what`` follows "a JSON object", ``hint`` the schema)."""
    if not isinstance(data, Mapping):
        raise BarrierGuardError(
            f"{source}: expected a JSON object{what}, got {type(data).__name__}"
        )
    if (found := data.get("schema")) != schema:
        raise BarrierGuardError(
            f"{source}: schema {found!r} is not supported; this barrierguard reads {schema!r}{hint}"
        )
