"""Where :class:`~tplower.core.traffic.CollectiveTraffic` was: it lives in :mod:`tplower.core.traffic` (the
architecture table of :mod:`tplower.run` counts bytes with it too, and ``run`` sits below ``bench``)."""

from __future__ import annotations

from ..core.traffic import CollectiveTraffic

__all__ = ["CollectiveTraffic"]
