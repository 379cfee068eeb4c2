"""What one rank of a probe checked, as JSON: written by the rank, read back by ``run.py``.

    write_report(out_dir, RankReport(rank=0, launcher="mpich", checks=(...), seconds=4.2))
    reports = read_reports(out_dir)   # every rank-<R>.json in out_dir, lowest rank first

A check is ``core`` (what the library promises today) or ``contract`` (the torchrun variables
after init, issue 16 item 6: expected to fail until the library exports them), so a verdict can
tell the two apart.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]
Kind = Literal["core", "contract"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One named check on one rank: ``pass``, ``fail`` or ``skip``, with what was seen."""

    name: str
    status: Status
    detail: str
    kind: Kind = "core"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """Every check of one rank; ``rank`` is what the launcher itself said (not distcompat)."""

    rank: int
    launcher: str
    checks: tuple[Check, ...]
    seconds: float

    def failed(self, kind: Kind) -> list[Check]:
        """The checks of ``kind`` that failed."""
        return [c for c in self.checks if c.status == "fail" and c.kind == kind]


def report_path(out_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its report."""
    return out_dir / f"rank-{rank}.json"


def write_report(out_dir: Path, report: RankReport) -> Path:
    """Write ``report`` atomically (temp file, then rename), so a reader never sees half of it."""
    path = report_path(out_dir, report.rank)
    temp = path.with_suffix(f".tmp{os.getpid()}")
    temp.write_text(json.dumps(asdict(report), indent=1), encoding="utf-8")
    os.replace(temp, path)
    return path


def _check(raw: dict[str, Any]) -> Check:
    return Check(
        name=str(raw["name"]),
        status=raw["status"],
        detail=str(raw["detail"]),
        kind=raw.get("kind", "core"),
    )


def read_reports(out_dir: Path) -> list[RankReport]:
    """Every ``rank-<R>.json`` in ``out_dir``, lowest rank first."""
    reports = []
    for path in sorted(out_dir.glob("rank-*.json")):
        raw = json.loads(path.read_text(encoding="utf-8"))
        reports.append(
            RankReport(
                rank=int(raw["rank"]),
                launcher=str(raw["launcher"]),
                checks=tuple(_check(c) for c in raw["checks"]),
                seconds=float(raw["seconds"]),
            )
        )
    return sorted(reports, key=lambda r: r.rank)
