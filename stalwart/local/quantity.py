"""Kubernetes resource quantities (``500m``, ``1.5``, ``2Gi``, ``1e3``) as exact numbers, for the scheduler's
arithmetic. Pure functions."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal("1e3"),
    "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity."""


def parse_quantity(value: str | int | float) -> Decimal:
    """The exact value of a quantity: ``"500m"`` -> 0.5, ``"2Gi"`` -> 2147483648, ``"1e3"`` -> 1000."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r}: expected a quantity such as 500m, 2 or 4Gi")
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    m = _QUANTITY.match(str(value).strip())
    if m is None:
        raise QuantityError(f"{value!r}: expected a quantity such as 500m, 2 or 4Gi")
    number, exponent, suffix = m.groups()
    try:
        base = Decimal(number)
        return base * Decimal(f"1{exponent}") if exponent else base * _SUFFIXES[suffix or ""]
    except InvalidOperation as exc:
        raise QuantityError(f"{value!r}: {exc}") from None


def milli(value: str | int | float) -> int:
    """A quantity in thousandths, rounded up (how the scheduler counts CPU: ``"100m"`` -> 100)."""
    return int((parse_quantity(value) * 1000).to_integral_value(rounding="ROUND_CEILING"))


def whole(value: str | int | float) -> int:
    """A quantity as a whole number, rounded up (memory in bytes, GPUs, pods)."""
    return int(parse_quantity(value).to_integral_value(rounding="ROUND_CEILING"))
