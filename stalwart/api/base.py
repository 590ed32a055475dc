"""The base of every stalwart API model and JSON record, and the cross-field rule mechanism.

Every model:
- speaks camelCase on the wire (YAML manifests, JSON records in etcd) and snake_case in Python;
- rejects unknown fields, so a typo is an error instead of a silently ignored setting;
- documents every field (``Field(description=...)``): the text becomes the CRD description and so what
  ``kubectl explain`` prints.

Cross-field rules (``minReplicas <= replicas`` and the like) are declared once per model as :class:`Rule`
objects in ``__rules__``. The same declaration gives the Python check (run by :func:`check_rules` from the
model's validator) and the CEL rule that :mod:`stalwart.api.crd` puts in the CRD, so the API server and
``stalwart validate`` cannot disagree on which rules exist or how their messages read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

#: The largest JSON document stalwart writes to or accepts from etcd or a peer (same cap as the store).
MAX_RECORD_BYTES = 256 * 1024


def positive_seconds(name: str, value: object) -> float:
    """``value`` as a number of seconds, or a ValueError naming ``name``: a duration, a timeout or an interval
    must be a finite number > 0 (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Rule:
    """One cross-field rule of a model.

    ``field`` is the wire (camelCase) path of the field the problem is reported on, relative to the model
    (e.g. ``"minReplicas"`` or ``"onExitCodes.values"``). ``cel`` is the same rule as a CEL expression over
    ``self`` (the model's object) for the CRD; ``message`` is the CRD's static message. ``check`` returns
    ``None`` when the rule holds, else the message for ``stalwart validate`` (which may name the values).
    """

    field: str
    cel: str
    message: str
    check: Callable[[Any], str | None]


class RuleViolation(ValueError):
    """Raised from a validator when rules fail; carries every failing (field, message).

    ``field`` is a wire path relative to the value the validator checked: ``"minReplicas"`` (a field of a
    model), ``"[2]"`` (an item of a list), or ``""`` (the value itself); ``stalwart validate`` appends it to
    the location pydantic reports.
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{field}: {message}" if field else message for field, message in problems))


def check_rules(model: BaseModel, rules: list[Rule]) -> None:
    """Evaluate ``rules`` on ``model``; raise :class:`RuleViolation` listing every rule that fails."""
    problems: list[tuple[str, str]] = []
    for rule in rules:
        message = rule.check(model)
        if message is not None:
            problems.append((rule.field, message))
    if problems:
        raise RuleViolation(problems)


class ApiModel(BaseModel):
    """Base of the TrainingJob models and of stalwart's JSON records.

    ``__rules__`` lists the model's cross-field rules; subclasses that declare rules call
    :func:`check_rules` from a ``model_validator(mode="after")``.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )

    __rules__: ClassVar[list[Rule]] = []

    def to_wire(self) -> dict[str, Any]:
        """The camelCase plain-data form, without unset optional fields (``None``)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def to_json_bytes(self) -> bytes:
        """The compact JSON form for etcd; raises ``ValueError`` above :data:`MAX_RECORD_BYTES`."""
        data = self.model_dump_json(by_alias=True, exclude_none=True).encode()
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(
                f"{type(self).__name__} is {len(data)} bytes as JSON; the limit is {MAX_RECORD_BYTES}")
        return data

    @classmethod
    def from_json_bytes(cls, data: bytes | str) -> Self:
        """Parse a JSON document (never pickle); raises ``ValueError`` when too large or invalid."""
        size = len(data.encode() if isinstance(data, str) else data)
        if size > MAX_RECORD_BYTES:
            raise ValueError(f"{cls.__name__} document is {size} bytes; the limit is {MAX_RECORD_BYTES}")
        return cls.model_validate_json(data)
