"""Shared test set-up: quiet DTensor's own CPU-fallback warnings, one thread per rank, ranks forked from a server."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

from hypothesis import settings

import tplower.testing
from tplower.conformance import quiet_dtensor_logs

quiet_dtensor_logs()
# Spawned ranks fork from one server that imported torch and tplower once (4 s saved per rank started), and
# transformers' model base, which most ranks here build models on (2-3 s of CPU more per rank).
tplower.testing.START_METHOD = "forkserver"
tplower.testing.PRELOAD = (*tplower.testing.PRELOAD, "transformers.modeling_utils", "transformers.generation.utils")

# CI runs the same examples every time; elsewhere hypothesis explores new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


import pytest  # noqa: E402

_COUNTS: dict[str, dict[str, int]] = {}
_RELIABILITY: dict[str, object] = {}


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Tests marked ``slow`` run with ``TPLOWER_SLOW=1`` (they repeat what faster tests check)."""
    if os.environ.get("TPLOWER_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: runs with TPLOWER_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def conformance_counts() -> dict[str, dict[str, int]]:
    """Where conformance tests leave their case counts for the end-of-run summary."""
    return _COUNTS


@pytest.fixture
def reliability_report() -> dict[str, object]:
    """Where reliability tests leave their figures for the end-of-run summary."""
    return _RELIABILITY


def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    if _RELIABILITY:
        terminalreporter.section("tplower reliability")
        for label, value in _RELIABILITY.items():
            terminalreporter.write_line(f"{label}: {value}")
    if not _COUNTS:
        return
    terminalreporter.section("tplower conformance against DTensor")
    total = 0
    for label, counts in _COUNTS.items():
        total += counts["cases"]
        detail = ", ".join(f"{k}={v}" for k, v in counts.items() if k != "cases")
        terminalreporter.write_line(f"{label}: {counts['cases']} cases ({detail})")
    terminalreporter.write_line(f"total: {total} cases checked forward and backward on every rank")


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a rank fails the test: every refusal in a test that takes this must come before."""

    def spawned(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank was started before the bad option was refused")

    import tplower.run.launch
    import tplower.testing

    monkeypatch.setattr(tplower.testing, "run_processes", spawned)
    monkeypatch.setattr(tplower.run.launch, "run_processes", spawned)


@pytest.fixture(scope="module")
def native_all_reduce() -> Iterator[None]:
    """gloo's small all_reduces run natively in the ranks a module spawns (``TPLOWER_GLOO_EXCHANGE_BYTES=0``).

    For modules that count collectives by kind against what the lowering names (``tplower explain``, the
    planner's prediction, the overlapped backward): on gloo a small ``all_reduce`` is otherwise carried by one
    ``all_to_all`` (:mod:`tplower.core.lower.exchange`, tested on its own in ``tests/test_exchange.py``).
    A module asks for it with an autouse module fixture, so its other module fixtures spawn after it is set.
    """
    from tplower.core.lower.backends import EXCHANGE_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EXCHANGE_ENV, "0")
        yield
