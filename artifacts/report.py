"""report.json / report.md: an evaluation's results (`specpilot eval --out DIR`, written by
`specpilot.eval.report.write_report`); read back by the console summary and the demo."""
from __future__ import annotations

from pathlib import Path

from specpilot.drafting.files import read_json

REPORT_JSON = "report.json"
REPORT_MD = "report.md"


def read_report(path: str | Path) -> dict:
    """An evaluation's report.json (the file, or the folder holding it); errors name the file."""
    path = Path(path)
    path = path / REPORT_JSON if path.is_dir() else path
    return read_json(path, what="evaluation report", fix="run `specpilot eval --out DIR` again")
