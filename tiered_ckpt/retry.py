"""Retries per tier: transient failures are retried with exponential backoff, jitter and a deadline.

What counts as transient: timeouts, throttling (S3 ``SlowDown``), 5xx answers, connection resets. Permission
errors, missing files, a full disk and bad configuration are permanent: retrying them only delays the report.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

import tenacity

from .config import RetryConfig
from .errors import PermanentTierError, TransientTierError

T = TypeVar("T")

_TRANSIENT_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
                     errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EBUSY}
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                     errno.EISDIR, errno.ENOTDIR, errno.EINVAL}
# Error codes and phrases that object stores and HTTP stacks use for "try again later".
_TRANSIENT_MARKERS = ("SlowDown", "Throttl", "RequestTimeout", "ServiceUnavailable", "InternalError",
                      "TooManyRequests", "503", "500 ", "502", "504", "timed out", "Timeout", "Connection reset",
                      "ConnectionReset", "Connection aborted", "ServerDisconnected", "temporarily unavailable",
                      "Broken pipe", "EndpointConnectionError")


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, TransientTierError):
        return True
    if isinstance(exc, (PermanentTierError, FileNotFoundError, PermissionError, KeyError, ValueError, TypeError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in _TRANSIENT_ERRNOS:
            return True
        if exc.errno in _PERMANENT_ERRNOS:
            return False
    text = f"{type(exc).__name__}: {exc}"
    if any(marker in text for marker in _TRANSIENT_MARKERS):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def call_with_retry(fn: Callable[[], T], cfg: RetryConfig,
                    on_retry: Callable[[int, BaseException, float], None] | None = None) -> T:
    """Call ``fn`` until it succeeds, a permanent error occurs, attempts run out or the deadline passes.

    ``on_retry(attempt, exception, sleep_s)`` is called before each wait (to emit a retry event). The last
    exception is re-raised unchanged.
    """

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            sleep = state.next_action.sleep if state.next_action else 0.0
            on_retry(state.attempt_number, state.outcome.exception(), sleep)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(cfg.attempts) | tenacity.stop_before_delay(cfg.deadline_s),
        # Jitter proportional to the first wait: many ranks retrying one store must not retry in lockstep.
        wait=tenacity.wait_exponential_jitter(multiplier=cfg.initial_s, max=cfg.max_s, jitter=cfg.initial_s),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(fn)
