"""Plain values for the reporter's calls: numpy scalars, Decimal and friends become int/float at
the call, and what cannot become one is refused there, with a TypeError or ValueError.

Why at the call: the sender thread encodes events later, where a bad value could only be dropped
(or, as it once did, wedge the queue). Refusing at the call puts the error on the line that made
it. The callers keep a fast path for plain ints and floats; these functions are the slow path.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import SupportsIndex, TypeGuard


def _is_bool(x: object) -> bool:
    return isinstance(x, bool) or type(x).__name__ in ("bool_", "bool")


def count(x: object, name: str, hi: int, lo: int = 0) -> int:
    """A whole number in [lo, hi] from an int-like (numpy integer, Decimal('2'), 2.0)."""
    if _is_bool(x) or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a whole number, got {type(x).__name__} {x!r}")
    n = _index(x)
    if n is None:
        f = _float_of(x, name)
        if not math.isfinite(f) or not f.is_integer():
            raise ValueError(f"{name} must be a finite whole number, got {x!r}") from None
        n = int(f)
    if not lo <= n <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {n}")
    return n


def number(x: object, name: str) -> float | int:
    """A finite int or float from any real number (numpy scalar, Decimal, Fraction)."""
    if _is_bool(x) or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__} {x!r}")
    if type(x) is int:
        return x
    n = _index(x)
    if n is not None:
        return n
    f = _float_of(x, name)
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return f


def timestamp(x: object, name: str = "ts") -> float:
    """Unix seconds as a finite float."""
    f = float(number(x, name))
    if f < 0:
        raise ValueError(f"{name} must be Unix seconds (>= 0), got {x!r}")
    return f


def _index(x: object) -> int | None:
    """`operator.index(x)`, or None for a value that is no integer (no `__index__`, or one that
    refuses with TypeError, as a float array's does)."""
    if not _has_index(x):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _has_index(x: object) -> TypeGuard[SupportsIndex]:
    # What operator.index looks up, on the type; isinstance(x, SupportsIndex) costs ~4 us a call.
    return hasattr(type(x), "__index__")


def _float_of(x: object, name: str) -> float:
    if not isinstance(x, numbers.Real) and not hasattr(type(x), "__float__"):
        raise TypeError(f"{name} must be a number, got {type(x).__name__} {x!r}")
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"{name} must be a number, got {type(x).__name__} {x!r}") from e


def text(x: object, name: str) -> str:
    """A string Redis can store: one with a lone surrogate (a file name or environment value
    decoded with `surrogateescape`) cannot be encoded as UTF-8, and would fail its whole batch
    in the sender thread, taking the good events of the batch with it."""
    if not isinstance(x, str):
        raise TypeError(f"{name} must be a string, got {type(x).__name__} {x!r}")
    if not x.isascii():
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{name} is not valid text (it holds a lone surrogate): {x!r}") from None
    return x


def plain(x: object, name: str, depth: int = 0) -> object:
    """A JSON-plain value (None, bool, str, finite int/float, lists and string-keyed dicts of those),
    for meta fields and preflight checks."""
    if isinstance(x, str):
        return text(x, name)
    if x is None or isinstance(x, bool) or type(x) is int:
        return x
    if _is_bool(x):
        return bool(x)
    if depth > 20:
        raise ValueError(f"{name} is nested too deeply")
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise TypeError(f"{name} keys must be strings, got {k!r}")
            out[text(k, f"{name} key")] = plain(v, f"{name}.{k}", depth + 1)
        return out
    if isinstance(x, (list, tuple)):
        return [plain(v, f"{name}[{i}]", depth + 1) for i, v in enumerate(x)]
    return number(x, name)
