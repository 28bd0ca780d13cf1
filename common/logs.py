"""Log output of the commands: human-readable lines, or (the servers' ``--log-format json``) one
JSON object per line for log collectors, so fields such as a call's peer or a shard stay
machine-readable."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import TextIO

LOG_FORMATS = ("text", "json")
# The text lines: a server's and a generation's carry the time; build_index's do not (its progress
# bar and summary say how long it took); rest-measure-cost narrates its measurement, messages only.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
UNTIMED_FORMAT = "%(levelname)s %(name)s: %(message)s"
MESSAGE_FORMAT = "%(message)s"
# The attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, then every ``extra=`` field (values JSON cannot hold are written as ``str``; the
    four fixed fields win over extras of the same name), ``exception`` and ``stack`` when present."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES:
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def configure_logging(
    level: int | str, fmt: str = "text", stream: TextIO | None = None, *, text_format: str = TEXT_FORMAT
) -> None:
    """Log records at ``level`` and above to ``stream`` (default: stderr) as ``fmt`` ("text", lines
    of ``text_format``, or "json"). Like ``logging.basicConfig``, does nothing when the root logger
    already has handlers."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(text_format))
    logging.basicConfig(level=level, handlers=[handler])
