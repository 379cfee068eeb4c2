"""The errors distcompat.diagnostics raises: a declared hang, and a collective in one-rank code.

::

    try:
        train()
    except HangError as exc:            # a TimeoutError (CollectiveTimeoutError): see exc.report
        print(exc.report.describe(stacks=True))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distcompat.collectives._errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from distcompat.diagnostics._report import HangReport

__all__ = ["HangError", "SingleRankCollectiveError"]


class HangError(CollectiveTimeoutError):
    """A collective did not complete within the watchdog timeout; ``report`` says why.

    Raised on the stuck rank instead of waiting out the group timeout, and on any rank at its next
    distcompat collective after a hang was declared (the group cannot be trusted any more).
    ``report`` is the cross-rank :class:`~distcompat.diagnostics.HangReport`.
    """

    def __init__(self, message: str, *, op: str, peer: int | None, report: HangReport) -> None:
        super().__init__(message, op=op, peer=peer)
        self.report = report


class SingleRankCollectiveError(RuntimeError):
    """A collective was called inside code that only one rank runs (it would hang the others).

    ``site`` is ``file:line`` of the call, ``region`` what made the code single-rank.
    """

    def __init__(self, op: str, site: str, region: str) -> None:
        super().__init__(
            f"{op} called at {site} inside single-rank code ({region}): the other ranks do not "
            "run this code, so the collective would wait for them forever. Run the collective "
            "on every rank, outside the rank-gated code, and gate only the side effect (logging, "
            "saving) on the result"
        )
        self.op = op
        self.site = site
        self.region = region
