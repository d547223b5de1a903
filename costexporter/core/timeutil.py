"""Time as users write it and as the core counts it (pure): the zones a `--tz` names, UTC times
written out, and seconds turned into the core's integer milliseconds (`to_ms`: one rule).

The replay report, calibrate's labels and the CLI's times read a zone the same way; the API, the
watcher's webhook and its Alertmanager alerts write a time the same way (`iso_utc`).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from zoneinfo import ZoneInfo

import numpy as np
import numpy.typing as npt


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


# RFC 3339's date-time (its lower-case `t` and `z` and a space for the `T` included): the API's
# window pattern is built from it, and `parse_instant` reads it.
RFC3339 = (
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt ]([01][0-9]|2[0-3]):[0-5][0-9]"
    r"(:[0-5][0-9](\.[0-9]{1,6})?)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)


def parse_instant(text: str, tz: dt.tzinfo | None = None) -> float:
    """A time as users write it -> Unix seconds: Unix seconds, RFC 3339, or ISO 8601. An ISO
    time without an offset is taken in `tz`; without `tz` it is refused (RFC 3339 needs one).
    The one time parser of the API's windows, OpenCost's windows, the FOCUS export and the CLI's
    times; raises ValueError with a one-line message."""
    t = text.strip()
    try:
        unix = float(t)
    except ValueError:
        pass
    else:
        if math.isfinite(unix):
            return unix
    iso = t
    rfc = re.fullmatch(RFC3339, t) is not None
    if rfc:  # RFC 3339 allows a lower-case t and z and a space; fromisoformat wants T and +00:00
        iso = t[:10] + "T" + t[11:]
        iso = iso[:-1] + "+00:00" if iso[-1] in "Zz" else iso
    try:
        d = dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        if rfc:
            raise ValueError(f"{text!r} is not a date in the calendar") from None
        raise ValueError(f"{text!r} is neither an RFC 3339 time nor Unix seconds") from None
    if d.tzinfo is None:
        if tz is None:
            raise ValueError(f"{text!r} has no time zone offset (RFC 3339 needs one, e.g. Z or +08:00)")
        d = d.replace(tzinfo=tz)
    try:
        return d.timestamp()
    except (ValueError, OverflowError):  # year 1 or 9999 with an offset that leaves the calendar
        raise ValueError(f"{text!r} is not a time this API can use") from None


def to_ms(seconds: float) -> int:
    """Seconds (a Unix time or a duration) as integer milliseconds: the nearest millisecond,
    ties to even. The one rounding rule at every edge where time enters in seconds (an event's
    or a registration's `ts`, a sample's time, a trace's column), so an event and a sample at
    the same instant land on the same millisecond, and a time written with three decimals
    reads back as the millisecond it was (truncating turns 1076499726.853 s, a float just
    below, into ...852 ms)."""
    return round(seconds * 1000)


def to_ms_array(seconds: np.ndarray) -> np.ndarray:
    """`to_ms` over an array (a trace's time column): the same rule, element by element."""
    return np.rint(np.asarray(seconds, np.float64) * 1000).astype(np.int64)


# A logged time: ISO 8601 date and time ('T', 't' or a space between; '/' for '-'), fractions of
# a second to the nanosecond, an optional zone (Z or +HH:MM / +HHMM); or Unix time as a number.
_ISO_RE = r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:?\d{2})?$"
_ZONE_RE = r"([Zz]|[+-]\d{2}:?\d{2})$"
_NUMBER_RE = r"^\d+(\.\d+)?$"
# Unix time told by magnitude (now: ~1.8e9 s): seconds below 1e11 (year 5138), then ms, us, ns.
UNIX_UNITS = ((1e11, "s", 1e3), (1e14, "ms", 1.0), (1e17, "us", 1e-3), (math.inf, "ns", 1e-6))


def parse_times(texts: object, tz: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_], str]:
    """A column of logged times (a pyarrow string array) -> UTC epoch ms (`to_ms`'s rounding),
    the rows that are no time, and how the column was read: "local" (no zone: taken in `tz`),
    "zoned" (each row's own zone; `tz` applies to the rows without one), or "unix_s", "unix_ms",
    "unix_us", "unix_ns" (a column of numbers: the unit told by their magnitude). The one
    vectorised rule of the trace readers. (`parse_instant`, the API's and the CLI's one value, is
    stricter: RFC 3339 needs a zone there, and a number is Unix seconds only.)"""
    import pyarrow as pa
    import pyarrow.compute as pc

    s = pc.replace_substring(pc.utf8_trim_whitespace(texts), "/", "-")
    n = len(s)
    empty = pc.equal(s, "").to_numpy(zero_copy_only=False)
    number = pc.fill_null(pc.match_substring_regex(s, _NUMBER_RE), False).to_numpy(zero_copy_only=False)
    if number.any() and (number | empty).all():
        v = pc.cast(pc.if_else(pa.array(number), s, pa.scalar(None, pa.string())), pa.float64())
        x = np.nan_to_num(v.to_numpy(zero_copy_only=False), nan=0.0)
        mag = float(np.median(x[number]))
        _top, unit, scale = next(u for u in UNIX_UNITS if mag < u[0])
        return np.rint(x * scale).astype(np.int64), ~number, f"unix_{unit}"
    ok = pc.fill_null(pc.match_substring_regex(s, _ISO_RE), False)
    zoned = pc.fill_null(pc.and_(ok, pc.match_substring_regex(s, _ZONE_RE)), False)
    # Arrow reads 'T' and '+HH:MM'; a lower-case t or z, or +HHMM, is written its way first.
    norm = pc.replace_substring_regex(s, r"^(\d{4}-\d{2}-\d{2})[t ]", r"\1T")
    norm = pc.replace_substring_regex(norm, r"[z]$", "Z")
    norm = pc.replace_substring_regex(norm, r"([+-]\d{2})(\d{2})$", r"\1:\2")
    null = pa.scalar(None, pa.string())
    naive = pc.cast(pc.if_else(pc.and_(ok, pc.invert(zoned)), norm, null), pa.timestamp("us"))
    if tz.upper() not in ("UTC", "Z", "+00:00"):
        naive = pc.assume_timezone(naive, timezone=tz, ambiguous="earliest", nonexistent="earliest")
    us = pc.fill_null(pc.cast(naive, pa.int64()), 0).to_numpy(zero_copy_only=False)
    z = zoned.to_numpy(zero_copy_only=False)
    if z.any():
        at = pc.cast(pc.if_else(zoned, norm, null), pa.timestamp("us", tz="UTC"))
        zus = pc.fill_null(pc.cast(at, pa.int64()), 0).to_numpy(zero_copy_only=False)
        us = np.where(z, zus, us)
    ms = np.rint(us.astype(np.float64) / 1000).astype(np.int64)
    bad = ~ok.to_numpy(zero_copy_only=False) if n else np.zeros(0, bool)
    return ms, bad, "zoned" if z.any() else "local"
