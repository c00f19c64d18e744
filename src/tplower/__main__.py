"""``python -m tplower``: the ``tplower`` command (:mod:`tplower.cli.main`)."""

from __future__ import annotations

from .cli.main import main

raise SystemExit(main())
