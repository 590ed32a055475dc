"""Retry policy: :class:`RetryOptions` and the pure backoff computation the scheduler uses."""

from __future__ import annotations

import math
import random
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RetryOptions(BaseModel):
    """How a request is retried. Validated when constructed; an error names the offending argument.

    Attempt ``n`` (the first retry is ``n = 1``) waits ``min(max_delay, initial_delay * multiplier**(n-1))``
    seconds, scaled by a uniform random factor in ``[1 - jitter, 1 + jitter]`` and capped again by
    ``max_delay``. No attempt starts after ``deadline`` seconds from the first send; the call then fails
    with the last error (or :class:`~stalwart.rpc.errors.RpcTimeout`). ``attempt_timeout``, when set,
    makes an attempt whose reply has not come within that many seconds count as failed (a lost message),
    so the request is sent again; duplicates are harmless because the callee deduplicates by request id.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_retries: int = Field(default=5, ge=0, le=10_000)
    initial_delay: float = Field(default=0.05, gt=0, le=3600)
    multiplier: float = Field(default=2.0, ge=1.0, le=100)
    max_delay: float = Field(default=2.0, gt=0, le=3600)
    jitter: float = Field(default=0.2, ge=0.0, le=1.0)
    deadline: float = Field(default=30.0, gt=0, le=86400)
    attempt_timeout: float | None = Field(default=None, gt=0, le=86400)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.max_delay < self.initial_delay:
            raise ValueError(f"max_delay ({self.max_delay}) must be >= initial_delay ({self.initial_delay})")
        if self.attempt_timeout is not None and self.attempt_timeout > self.deadline:
            raise ValueError(
                f"attempt_timeout ({self.attempt_timeout}) must be <= deadline ({self.deadline})")
        for name in ("initial_delay", "max_delay", "deadline", "multiplier", "jitter"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite")
        return self


#: Options of the RRef protocol's control messages (fork, accept, delete, fetch, done): idempotent, so they
#: are retried on every failure, lost replies included, until their deadline.
CONTROL_RETRY = RetryOptions(max_retries=1000, initial_delay=0.02, multiplier=2.0, max_delay=1.0, jitter=0.2,
                             deadline=60.0, attempt_timeout=5.0)


def backoff_delay(options: RetryOptions, retry: int, rng: random.Random) -> float:
    """Seconds to wait before retry number ``retry`` (1 for the first retry), jitter applied."""
    if retry < 1:
        raise ValueError(f"retry must be >= 1, got {retry}")
    exponent = retry - 1
    if options.multiplier > 1.0:
        # beyond this exponent the delay is capped anyway; stopping there avoids float overflow
        exponent = min(exponent, math.ceil(math.log(options.max_delay / options.initial_delay)
                                           / math.log(options.multiplier)) + 1)
    base = min(options.max_delay, options.initial_delay * options.multiplier ** exponent)
    if options.jitter:
        base *= 1.0 + options.jitter * (2.0 * rng.random() - 1.0)
    return max(0.0, min(options.max_delay, base))
