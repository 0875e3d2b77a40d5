"""Access log: one JSON object per finished call, on either port.

Where it goes (`--access-log`): by default the process's normal log, as the message of
logger `tracewire.access` (the JSON follows the usual `time level name: ` prefix, so one
stream carries everything); `--access-log FILE` appends bare JSON lines to FILE instead
(one write per line: the frontends of `--frontends N` can share the file); `off` drops it.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

LOGGER = logging.getLogger("tracewire.access")
OFF = "off"


def configure(destination: str) -> None:
    """"" (the normal log), a file path, or "off"."""
    for handler in list(LOGGER.handlers):
        LOGGER.removeHandler(handler)
        handler.close()
    if destination == OFF:
        LOGGER.disabled = True
        return
    LOGGER.disabled = False
    LOGGER.setLevel(logging.INFO)
    if destination:
        handler = logging.FileHandler(destination, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        LOGGER.addHandler(handler)
        LOGGER.propagate = False
    else:
        LOGGER.propagate = True


def write(
    *,
    method: str,
    transport: str,
    code: str,
    http_status: int | None,
    duration_ms: float,
    request_id: str,
    peer: str,
    bytes_sent: int,
    tenant: str,
) -> None:
    if not LOGGER.isEnabledFor(logging.INFO):
        return
    line: dict[str, object] = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "request_id": request_id,
        "method": method,
        "transport": transport,
        "code": code,
        "duration_ms": duration_ms,
        "peer": peer,
        "bytes_sent": bytes_sent,
    }
    if http_status is not None:
        line["http_status"] = http_status
    if tenant:
        line["tenant"] = tenant
    LOGGER.info(json.dumps(line, ensure_ascii=True, separators=(",", ":")))
