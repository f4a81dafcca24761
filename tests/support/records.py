"""What a telemetry core records, as its writer gets it: the workers of the collective tests read the records
of a real ``Telemetry`` (its flusher, its steps) without a store in between."""

from __future__ import annotations

from typing import Any, Callable


def capture_records(tel: Any, kinds: tuple[str, ...] = ("collective", "step")) -> Callable[[], dict[str, list[dict]]]:
    """From now on, every record of ``kinds`` ``tel`` pushes is also kept (the writer still gets it); the
    returned callable gives them so far as dicts of the record's fields, per kind."""
    got: dict[str, list[tuple]] = {kind: [] for kind in kinds}
    push = tel._push

    def capture(kind: str, row: tuple) -> None:
        if kind in got:
            got[kind].append(row)
        push(kind, row)

    tel._push = capture

    def records() -> dict[str, list[dict]]:
        from meshscope.agent.contract import SCHEMAS

        # a row is (its layout tag, its fields in order)
        return {kind: [dict(zip(SCHEMAS[kind].names, row[1:])) for row in rows] for kind, rows in got.items()}

    return records
