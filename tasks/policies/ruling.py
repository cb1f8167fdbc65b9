"""The one answer every policy check gives (a ruling): what it made of a value, and a stable reason with a detail when it refuses.

Not to be confused with ``tasks.stages.runner.Verdict``: a sample's whole outcome (its ledger
row and what to write), which a stage builds from one or more rulings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from tasks.formats.reasons import status_of

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Ruling(Generic[T]):
    """What a policy check decided about one sample's value.

    Args:
        value: what the check made of the input, also on a refusal where it is known (the
            report shows it): the cleaned caption, the SPDX id or expression, the sniffed image
            format, the URL as checked. Default None.
        reason: None when the value passes; else a stable snake_case reason registered in
            tasks/formats/reasons.py (an unregistered one raises ``ValueError`` here, so a
            check cannot invent a reason the ledger and the gates do not know). Default None.
        detail: for people: which value and why it was refused. Default None.

    The checks that answer with it: ``license_verdict``, ``caption_verdict``, ``check_url``,
    ``bytes_verdict``, ``RobotsRules.verdict`` and ``x_robots_verdict``.
    """

    value: T | None = None
    reason: str | None = None
    detail: str | None = None

    def __post_init__(self) -> None:
        if self.reason is not None:
            status_of(self.reason)

    @property
    def ok(self) -> bool:
        """The value passes."""
        return self.reason is None
