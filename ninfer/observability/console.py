"""Console lines for operators: `[YYYY-MM-DD HH:MM:SS.mmm] [level] message` in local time, on stderr.

These are rounded summaries; the JSONL request log (`request_log`) is the aggregation source.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

LOGGER = "ninfer"


class ConsoleFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        local = time.localtime(record.created)
        return f"{time.strftime('%Y-%m-%d %H:%M:%S', local)}.{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        line = f"[{self.formatTime(record)}] [{record.levelname.lower()}] {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_console(stream: TextIO | None = None, level: int = logging.INFO) -> logging.Handler:
    """Send the `ninfer` loggers (the HTTP server's included: it logs through `ninfer.http`) to `stream`."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(ConsoleFormatter())
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
