"""The structured request log (serving.md): `--request-log-jsonl FILE`, one `ninfer_serve_request_log` schema-v12
JSON object per line, appended and flushed per event.

Every event carries `timestamp_unix_ms` and the process-unique `server_instance_id`. Numbers are written at full
precision (JSON floats are Python's shortest round-trip repr). The log never holds generated text or the API key.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Sequence, TextIO

ARTIFACT_TYPE = "ninfer_serve_request_log"
SCHEMA_VERSION = 12
REDACTED = "<redacted>"
SECRET_OPTIONS = ("--api-key",)


class RequestLogError(OSError):
    """The log file cannot be used (startup aborts)."""


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv with the value of every secret option replaced (`--api-key KEY` and `--api-key=KEY`)."""
    redacted, hide_next = [], False
    for arg in argv:
        if hide_next:
            redacted.append(REDACTED)
            hide_next = False
        elif arg in SECRET_OPTIONS:
            redacted.append(arg)
            hide_next = True
        elif arg.split("=", 1)[0] in SECRET_OPTIONS and "=" in arg:
            redacted.append(f"{arg.split('=', 1)[0]}={REDACTED}")
        else:
            redacted.append(arg)
    return redacted


class RequestLog:
    """The JSONL writer (a no-op without a file) and the source of request ids, which are monotonic within this
    server instance and given whether or not the file is enabled (console lines use them too)."""

    def __init__(self, file: TextIO | None = None) -> None:
        self.server_instance_id = uuid.uuid4().hex
        self._file = file
        self._last_id = 0

    @classmethod
    def open(cls, path: Path | None, *, artifact: Path) -> RequestLog:
        """Append to `path` (None: no file). Its directory must exist, and it must not be the artifact."""
        if path is None:
            return cls()
        if not path.parent.is_dir():
            raise RequestLogError(f"--request-log-jsonl {path}: the directory {path.parent} does not exist")
        if os.path.realpath(path) == os.path.realpath(artifact):
            raise RequestLogError(f"--request-log-jsonl {path} is the model artifact")
        try:
            return cls(open(path, "a", encoding="utf-8"))
        except OSError as exc:
            raise RequestLogError(f"--request-log-jsonl {path}: {exc}") from exc

    def new_request_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"artifact_type": ARTIFACT_TYPE, "schema_version": SCHEMA_VERSION, "event": event,
                  "timestamp_unix_ms": time.time_ns() // 1_000_000, "server_instance_id": self.server_instance_id,
                  **fields}
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
