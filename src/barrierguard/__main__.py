"""``python -m barrierguard``: the same as the ``barrierguard`` command."""

from __future__ import annotations

import sys

from barrierguard.cli.main import main

sys.exit(main())
