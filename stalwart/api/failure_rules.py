"""Failure rules: which failures a TrainingJob restarts in process, answers by replacing the pod, or ends the job
on (the ``restartPolicy.rules`` of the spec)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator

from stalwart.api.base import ApiModel, Rule, RuleViolation, check_rules

__all__ = ["ExitCodeMatch", "ExitCodeOperator", "FailureAction", "FailureReason", "FailureRule"]


class FailureAction(StrEnum):
    """What to do about a failure that a rule matches."""

    RESTART_IN_PROCESS = "RestartInProcess"
    REPLACE_POD = "ReplacePod"
    FAIL_JOB = "FailJob"


class FailureReason(StrEnum):
    """Why a rank or pod failed, as stalwart classifies it."""

    EXCEPTION = "Exception"  # the training function raised
    HANG = "Hang"  # no progress for softTimeoutSeconds
    PROCESS_EXITED = "ProcessExited"  # a rank process died (its exit code is matched by onExitCodes)
    OOM_KILLED = "OOMKilled"  # a container was killed for exceeding its memory limit
    EVICTED = "Evicted"  # the pod was evicted or preempted
    POD_LOST = "PodLost"  # the pod vanished (deleted, lease expired)
    NODE_LOST = "NodeLost"  # the pod's node stopped reporting or was lost (a PodLost rule matches it too)


class ExitCodeOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"


class ExitCodeMatch(ApiModel):
    """Matches a rank process's exit code."""

    operator: ExitCodeOperator = Field(
        description="In: the exit code is one of values. NotIn: it is none of them.")
    values: list[Annotated[int, Field(ge=0, le=255)]] = Field(
        description="Exit codes, 0..255, distinct. 0 (success) cannot be used with In.",
        min_length=1, max_length=256, json_schema_extra={"x-kubernetes-list-type": "set"})

    @field_validator("values")
    @classmethod
    def _distinct(cls, values: list[int]) -> list[int]:
        seen: set[int] = set()
        for index, value in enumerate(values):
            if value in seen:
                raise RuleViolation([(f"[{index}]", f"exit code {value} is listed twice")])
            seen.add(value)
        return values

    __rules__: ClassVar[list[Rule]] = [
        Rule(
            field="values",
            cel="self.operator != 'In' || !self.values.exists(v, v == 0)",
            message="exit code 0 (success) cannot be used with operator In",
            check=lambda s: None if s.operator != ExitCodeOperator.IN or 0 not in s.values else
            "exit code 0 (success) cannot be used with operator In"),
    ]

    @model_validator(mode="after")
    def _rules(self) -> ExitCodeMatch:
        check_rules(self, self.__rules__)
        return self


class FailureRule(ApiModel):
    """One failure rule: if a failure matches onExitCodes or onReasons, take action. The first matching
    rule in the list wins."""

    action: FailureAction = Field(
        description=("RestartInProcess: restart the healthy ranks in process (counts against "
                     "inProcess.maxRestarts). ReplacePod: replace the failed pod, a spare taking over its "
                     "ranks (counts against backoffLimit). FailJob: end the job as Failed."))
    on_exit_codes: ExitCodeMatch | None = Field(
        default=None, description="Match a rank process's exit code.")
    on_reasons: list[FailureReason] | None = Field(
        default=None, min_length=1, max_length=len(FailureReason),
        description=("Match the failure's reason: Exception (the training function raised), Hang (no "
                     "progress for softTimeoutSeconds), ProcessExited (a rank process died), OOMKilled, "
                     "Evicted, PodLost (the pod vanished; also matches NodeLost), NodeLost (its node was lost)."),
        json_schema_extra={"x-kubernetes-list-type": "set"})

    __rules__: ClassVar[list[Rule]] = [
        Rule(
            field="onExitCodes",
            cel="has(self.onExitCodes) || has(self.onReasons)",
            message="a rule needs onExitCodes or onReasons (or both)",
            check=lambda s: None if s.on_exit_codes is not None or s.on_reasons is not None else
            "a rule needs onExitCodes or onReasons (or both)"),
    ]

    @model_validator(mode="after")
    def _rules(self) -> FailureRule:
        check_rules(self, self.__rules__)
        return self
