"""What a benchmark script leaves: its table printed, and where asked the table with a note on
how it was measured (--markdown) and every record (--json)."""

import json
from pathlib import Path


def write_results(table: str, note: str, records, markdown=None, json_path=None) -> None:
    print(table)
    if markdown:
        Path(markdown).write_text(f"{table}\n\n{note}\n")
    if json_path:
        Path(json_path).write_text(json.dumps(records, indent=1))
