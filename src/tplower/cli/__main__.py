"""``python -m tplower.cli``: the ``tplower`` command."""

from __future__ import annotations

from .main import main

raise SystemExit(main())
