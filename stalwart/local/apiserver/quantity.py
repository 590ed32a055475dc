"""Resource quantities (``500m``, ``1Gi``, ``1e3``) parsed as Kubernetes' ``resource.Quantity`` does, to exact
decimals. What does not parse is a decoding error of the whole request (400), as on a real API server."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
DECODE_ERROR = f"quantities must match the regular expression '{PATTERN}'"
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
            "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
            "E": Decimal(10**18)}


class QuantityError(ValueError):
    """A quantity that does not parse; the message is the API server's."""


def parse(value: object) -> Decimal:
    """The quantity ``value`` (a string, or a number as JSON sends it)."""
    if isinstance(value, bool):
        raise QuantityError(DECODE_ERROR)
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    text = str(value).strip()
    m = re.match(PATTERN, text)
    if not m:
        raise QuantityError(DECODE_ERROR)
    number, suffix = m.groups()
    try:
        base = Decimal(number)
    except InvalidOperation:
        raise QuantityError(DECODE_ERROR) from None
    if suffix in _BINARY:
        return base * _BINARY[suffix]
    if suffix in _DECIMAL:
        return base * _DECIMAL[suffix]
    exp = re.fullmatch(r"[eE]([-+]?[0-9]+)", suffix)
    if exp:
        return base * Decimal(10) ** int(exp.group(1))
    raise QuantityError("unable to parse quantity's suffix")


def canonical(value: object) -> str:
    """The quantity as the API server prints it back in messages (the input, trimmed)."""
    return str(value).strip()
