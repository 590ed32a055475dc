"""The job-level in-process restart settings, one row each: the name of each in the TrainingJob's
``spec.restartPolicy.inProcess`` (and in the JobRecord the agents read), in the rank's environment, and in the
rank's ``RestartConfig``; and the order the timeouts keep.

A setting travels spec -> JobRecord (the operator) -> pod environment (the agent, per rank) -> RestartConfig
(the restart wrapper, for the options its decorator leaves out). Each step's mapping and the order check are
built from this table, so a new setting is a row here plus the field in each model that carries it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stalwart.api.base import Rule

__all__ = ["RESTART_SETTINGS", "SHORTER_THAN", "RestartSetting", "by_option", "order_problem", "order_rules"]


@dataclass(frozen=True, slots=True)
class RestartSetting:
    #: The RestartConfig option and the RankEnvironment field (``soft_timeout``).
    option: str
    #: The field of InProcessRestart and JobRecord (``soft_timeout_seconds``).
    field: str
    #: Its name in the manifest (``softTimeoutSeconds``).
    wire: str
    #: The rank's environment variable (``STALWART_SOFT_TIMEOUT``).
    env: str


RESTART_SETTINGS: tuple[RestartSetting, ...] = (
    RestartSetting("max_restarts", "max_restarts", "maxRestarts", "STALWART_MAX_RESTARTS"),
    RestartSetting("soft_timeout", "soft_timeout_seconds", "softTimeoutSeconds", "STALWART_SOFT_TIMEOUT"),
    RestartSetting("hard_timeout", "hard_timeout_seconds", "hardTimeoutSeconds", "STALWART_HARD_TIMEOUT"),
    RestartSetting("barrier_timeout", "barrier_timeout_seconds", "barrierTimeoutSeconds", "STALWART_BARRIER_TIMEOUT"),
)

#: (shorter, longer) by option: wherever both are set the first must be below the second (a rank is judged hung
#: at the soft timeout and killed at the hard one).
SHORTER_THAN: tuple[tuple[str, str], ...] = (("soft_timeout", "hard_timeout"),)


def by_option(option: str) -> RestartSetting:
    for setting in RESTART_SETTINGS:
        if setting.option == option:
            return setting
    raise KeyError(f"no restart setting named {option!r}")


def _ordered_pairs() -> list[tuple[RestartSetting, RestartSetting]]:
    return [(by_option(short), by_option(long)) for short, long in SHORTER_THAN]


def order_problem(value: Callable[[RestartSetting], float | None],
                  name: Callable[[RestartSetting], str]) -> tuple[str, str] | None:
    """The first pair of :data:`SHORTER_THAN` out of order, as (the longer's name, what is wrong), where
    ``value`` reads a setting (``None``: not set) and ``name`` names one as the caller's users know it."""
    for short, long in _ordered_pairs():
        s, v = value(short), value(long)
        if s is not None and v is not None and v <= s:
            return name(long), f"must exceed {name(short)} ({s:g}), got {v:g}"
    return None


def order_rules() -> list[Rule]:
    """The CEL rules (with their Python checks) that keep :data:`SHORTER_THAN` on a model with the settings'
    fields (InProcessRestart, JobRecord)."""
    rules = []
    for short, long in _ordered_pairs():

        def check(model: object, short: RestartSetting = short, long: RestartSetting = long) -> str | None:
            s, v = getattr(model, short.field), getattr(model, long.field)
            return None if s < v else f"must be less than {long.wire} ({v:g}), got {s:g}"

        rules.append(Rule(field=short.wire, cel=f"self.{short.wire} < self.{long.wire}",
                          message=f"{short.wire} must be less than {long.wire}", check=check))
    return rules
