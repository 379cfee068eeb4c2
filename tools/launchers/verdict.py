"""One verdict per launch from its processes' exits and its ranks' reports.

    verdict = judge(ranks=3, finished=[...], reports=read_reports(work))
    print(f"launcher mpich: {verdict.line}")     # "pass (3 ranks, 9.1 s)" or "FAIL <reason>"

Core failures come first; the contract check (``torchrun-env-after-init``) is reported after
them under its own name, so a launch whose only failure is the contract says exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from procs import Finished
from report import Check, Kind, RankReport


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """``ok`` and the text after ``launcher NAME:``."""

    ok: bool
    line: str


def _summarise(reports: Sequence[RankReport], kind: Kind) -> list[str]:
    """One entry per failing check name: the lowest rank's detail, and which other ranks agree."""
    by_name: dict[str, list[tuple[int, Check]]] = {}
    for report in reports:
        for check in report.failed(kind):
            by_name.setdefault(check.name, []).append((report.rank, check))
    parts = []
    for name, seen in by_name.items():
        rank, check = seen[0]
        others = [str(r) for r, _ in seen[1:]]
        also = f" (also ranks {', '.join(others)})" if others else ""
        parts.append(f"{name} on rank {rank}: {check.detail}{also}")
    return parts


def judge(
    *, ranks: int, finished: Sequence[Finished], reports: Sequence[RankReport], seconds: float
) -> Verdict:
    """Pass only when every process exited 0 and every rank reported every check passing."""
    problems: list[str] = []
    hung = [f for f in finished if f.timed_out]
    if hung:
        problems.append(
            f"timed out after {hung[0].seconds:.0f} s (killed; a hung launch fails): "
            f"{hung[0].tail()}"
        )
    seen = sorted(r.rank for r in reports)
    if seen != list(range(ranks)):
        missing = sorted(set(range(ranks)) - set(seen))
        problems.append(f"ranks {missing} wrote no report (reports from {seen})")
    problems += _summarise(reports, "core")
    failed_exit = [f for f in finished if not f.timed_out and f.returncode != 0]
    if failed_exit:
        problems.append(f"exit code {failed_exit[0].returncode}: {failed_exit[0].tail()}")
    contract = _summarise(reports, "contract")
    if not problems and not contract:
        return Verdict(ok=True, line=f"pass ({ranks} ranks, {seconds:.1f} s)")
    if not problems:
        lead = f"only the contract check failed ({ranks} ranks, {seconds:.1f} s; core pass): "
        return Verdict(ok=False, line="FAIL " + lead + "; ".join(contract))
    text = "; ".join(problems + [f"[contract] {c}" for c in contract])
    return Verdict(ok=False, line=f"FAIL {text} ({seconds:.1f} s)")
