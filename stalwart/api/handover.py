"""The record an agent hands a running rank process when a new rendezvous round takes it over.

A rank process of a surviving pod is not started again when a round ends: its agent joins the new round
and writes a :class:`Handover` to the process's handover file (``STALWART_HANDOVER_FILE``, in the agent's
private run dir, atomically replaced). The process's wrapper leaves the old round (its epoch is fenced out
by then) and continues in the new one with the variables below. A warm spare's processes start *parked*
(``STALWART_PARKED=true``, no epoch yet) and wait for their first handover.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from stalwart.api import pod_env
from stalwart.api.base import ApiModel

__all__ = ["HANDOVER_FILE_ENV", "PARKED_ENV", "Handover"]

#: The variables, as the pod contract names them.
HANDOVER_FILE_ENV = pod_env.HANDOVER_FILE
PARKED_ENV = pod_env.PARKED


class Handover(ApiModel):
    """A new round for a running rank process: its epoch and the environment of the new assignment."""

    epoch: int = Field(ge=1, description="The new round's epoch (its fencing token).")
    round: int = Field(ge=1, description="The new round's number.")
    env: dict[str, str] = Field(
        description="The variables of the new assignment (torchrun's and STALWART_*), as the agent would give "
                    "a process it started for this round.")

    @field_validator("env")
    @classmethod
    def _names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not name or not all(c.isalnum() or c == "_" for c in name):
                raise ValueError(f"env: {name!r} is not a variable name")
        if pod_env.EPOCH not in env:
            raise ValueError(f"env: {pod_env.EPOCH} is required")
        return env
