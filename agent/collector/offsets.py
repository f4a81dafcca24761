"""The agent's durable spool offsets: ``<store>/agent/offsets.json``.

``{"version": 1, "files": {"spool/<run>/rank-<r>.a<a>.spool": {"stream": "<id>", "offset": N}}}``: for
each spool file generation (``stream``, from its header), the byte offset up to which every record is in
the run store. Written to a temporary file and renamed over the old one, so a crash leaves either the old
or the new content, never a torn file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VERSION = 1


class OffsetStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.load_error = ""

    def load(self) -> dict[str, dict]:
        """The saved entries; {} when there is no file. A damaged file also gives {} (recorded in
        ``load_error``): the agent then recovers positions from the part files it finds."""
        try:
            data = json.loads(self.path.read_text())
            files = data["files"]
            if data.get("version") != VERSION or not isinstance(files, dict):
                raise ValueError(f"unexpected offsets file version {data.get('version')!r}")
            return {str(k): {"stream": str(v["stream"]), "offset": int(v["offset"])} for k, v in files.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.load_error = f"{self.path}: {type(exc).__name__}: {exc}"
            return {}

    def save(self, entries: dict[str, dict]) -> None:
        """Atomically replace the file; raises OSError (the caller counts it and retries later)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as fh:
            json.dump({"version": VERSION, "files": entries}, fh, sort_keys=True)
        os.replace(tmp, self.path)
