"""Flower's process-starting fixtures on a loaded machine: a deadline, a second try of a start that Ray or Flower
lost, and, if that fails too, each test that needs the fixture fails with the fixture's reason (instead of every
test of the module erroring at the fixture).

    runs = started("the Flower simulation", lambda: simulate_everything(...))
    ...
    def test_x(runs):
        fit, flower = runs["fedavg"]  # NotStarted: pytest.fail with the reason the simulation did not start
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, Union

import pytest

T = TypeVar("T")


class NotStarted:
    """What a fixture returns whose processes did not start or run: every use fails the test with the reason."""

    def __init__(self, what: str, reason: str):
        self.what, self.reason = what, reason

    def fail(self) -> NoReturn:
        pytest.fail(f"{self.what} did not run (twice): {self.reason}", pytrace=False)

    def __getitem__(self, key: Any) -> NoReturn:
        self.fail()

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        self.fail()


def started(what: str, start: Callable[[int], T], attempts: int = 2) -> Union[T, NotStarted]:
    """``start(attempt)`` (its own deadlines inside) until it returns, at most ``attempts`` times; ``NotStarted``
    with each attempt's reason when none did. ``attempt`` (0, 1, ...) lets a retry use fresh folders."""
    reasons = []
    for attempt in range(attempts):
        try:
            return start(attempt)
        except (Exception, pytest.fail.Exception) as error:  # pytest.fail inside: a deadline passed
            text = str(error).strip()
            reasons.append(f"{type(error).__name__}: {text[-2000:] if text else '(no message)'}")
    return NotStarted(what, " | then: ".join(reasons))
