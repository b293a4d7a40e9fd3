"""``ElasticSession``'s keyword arguments, checked as ``config.validate`` checks the job's
options, each refusal one line naming the argument and what it must be."""

from __future__ import annotations

from elastic_train.config import RECOVERY_MODES, SAVE_FAILURE_POLICIES
from elastic_train.errors import ConfigError

__all__ = ["check_session_options"]


def check_session_options(*, checkpoint_every: int | None, preemption_budget: float | None,
                          on_save_failure: str, recovery: str,
                          step_timeout: float | None) -> None:
    """``ElasticSession``'s arguments, checked as ``validate`` checks the job's options and
    named as the keyword arguments a hand-written loop passes."""
    if checkpoint_every is not None and checkpoint_every <= 0:
        raise ConfigError(f"checkpoint_every {checkpoint_every} is invalid: it must be a "
                          "positive number of steps, or None")
    if preemption_budget is not None and preemption_budget <= 0:
        raise ConfigError(f"preemption_budget {preemption_budget} is invalid: it must be a "
                          "positive number of seconds, or None")
    if on_save_failure not in SAVE_FAILURE_POLICIES:
        raise ConfigError(f"on_save_failure {on_save_failure!r} is invalid: use one of "
                          f"{', '.join(SAVE_FAILURE_POLICIES)}")
    if recovery not in RECOVERY_MODES:
        raise ConfigError(f"recovery {recovery!r} is invalid: use one of "
                          f"{', '.join(RECOVERY_MODES)}")
    if step_timeout is not None and step_timeout <= 0:
        raise ConfigError(f"step_timeout {step_timeout} is invalid: it must be a positive "
                          "number of seconds, or None")
