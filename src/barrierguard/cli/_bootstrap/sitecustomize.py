"""Started by ``barrierguard run`` for its Python children (see ``barrierguard.cli.follow``).

Runs the ``sitecustomize`` this one shadows, if there is one, then watches the
child when it re-executes the job's script or module. Never raises.
"""

from __future__ import annotations


def _bootstrap() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as exc:
        print(f"barrierguard: the shadowed sitecustomize failed: {exc!r}", file=sys.stderr)
    if not os.environ.get("BARRIERGUARD_FOLLOW"):
        return
    try:
        from barrierguard.cli.follow import start_child

        start_child()
    except ImportError:
        return  # another interpreter, without barrierguard: not followed
    except Exception as exc:
        print(f"barrierguard: this child is not watched: {exc!r}", file=sys.stderr)


_bootstrap()
