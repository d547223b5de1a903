"""Time as users write it (pure): the zones a `--tz` names, and UTC times written out.

The replay report, calibrate's labels and the CLI's times read a zone the same way; the API, the
watcher's webhook and its Alertmanager alerts write a time the same way (`iso_utc`).
"""

from __future__ import annotations

import datetime as dt
import re
from zoneinfo import ZoneInfo


def tz_zone(tz: str) -> dt.tzinfo:
    """The zone a --tz names (IANA name, UTC/Z or +HH:MM, as the CLI checks it) as a tzinfo."""
    if tz.upper() in ("UTC", "Z"):
        return dt.timezone.utc
    if m := re.fullmatch(r"([+-])(\d{2}):(\d{2})", tz):
        sign = 1 if m[1] == "+" else -1
        return dt.timezone(sign * dt.timedelta(hours=int(m[2]), minutes=int(m[3])))
    return ZoneInfo(tz)


def iso_utc(ts: float) -> str:
    """Unix seconds as RFC 3339 in UTC with a `Z` (fractions of a second only where there are)."""
    return dt.datetime.fromtimestamp(float(ts), dt.timezone.utc).isoformat().replace("+00:00", "Z")
