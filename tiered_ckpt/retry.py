"""Retries: which failures are worth another try, and the tenacity policies that try again.

What counts as transient: timeouts, throttling (S3 ``SlowDown``), 5xx answers, connection resets, and a write
whose temporary file vanished before its rename (a concurrent ``gc``). Permission errors, missing files, a full
disk, corruption and bad configuration are permanent: retrying them only delays the report.

This module is the one place that decides it: the errno table below is what every tier maps ``OSError`` with
(``tiers/_files.tier_error``), :func:`is_transient` is what every policy retries on, and the policies are
tenacity's. Two layers use them:

* the engine's per-tier policy (:func:`call_with_retry`, the tier's ``retry`` settings: attempts, backoff,
  deadline, ``retry`` events), around whole operations (write a file, read a manifest);
* a tier's tries of one request (:func:`request_retrying`: the S3 tier tries each HTTP request
  ``request_attempts`` times with a short backoff, so one throttled part does not restart a 10 GiB upload).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

import tenacity

from .config import RetryConfig
from .errors import CorruptionError, PermanentTierError, TransientTierError

T = TypeVar("T")

# ----- the errno table ---------------------------------------------------------------------------------------
# Worth another try. EBUSY and EREMOTEIO are also what s3fs makes of HTTP 503 (SlowDown) and 500 (InternalError);
# ESTALE is an NFS handle that a new open replaces; EINTR an interrupted call.
TRANSIENT_ERRNOS = frozenset({
    errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE, errno.EAGAIN,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EBUSY, errno.ESTALE, errno.EINTR,
    errno.EREMOTEIO,
})
# The disk or the quota is full: permanent, and reported as "disk full" (memory tiers: a CapacityError).
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Permanent, and decided here rather than by the message text.
PERMANENT_ERRNOS = FULL_ERRNOS | {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.EISDIR,
                                  errno.ENOTDIR, errno.EINVAL, errno.ELOOP, errno.ENXIO}

# Error codes and phrases that object stores and HTTP stacks use for "try again later".
_TRANSIENT_MARKERS = ("SlowDown", "Throttl", "RequestTimeout", "ServiceUnavailable", "InternalError",
                      "TooManyRequests", "503", "500 ", "502", "504", "timed out", "Timeout", "Connection reset",
                      "ConnectionReset", "Connection aborted", "ServerDisconnected", "temporarily unavailable",
                      "Broken pipe", "EndpointConnectionError")

# One request's tries (request_retrying): the first wait, doubling up to the last, jittered.
REQUEST_FIRST_WAIT_S = 0.2
REQUEST_MAX_WAIT_S = 2.0


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, TransientTierError):
        return True
    if isinstance(exc, (PermanentTierError, CorruptionError, FileNotFoundError, PermissionError, KeyError,
                        ValueError, TypeError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in TRANSIENT_ERRNOS:
            return True
        if exc.errno in PERMANENT_ERRNOS:
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
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(cfg.attempts) | tenacity.stop_before_delay(cfg.deadline_s),
        # Jitter proportional to the first wait: many ranks retrying one store must not retry in lockstep.
        wait=tenacity.wait_exponential_jitter(multiplier=cfg.initial_s, max=cfg.max_s, jitter=cfg.initial_s),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=_before_sleep(on_retry),
        reraise=True,
    )
    return retrying(fn)


def request_retrying(attempts: int, *, on_retry: Callable[[int, BaseException, float], None] | None = None,
                     give_up: Callable[[], bool] | None = None,
                     asynchronous: bool = False) -> tenacity.Retrying | tenacity.AsyncRetrying:
    """The policy of one request's tries: ``attempts`` in all, transient failures only, a short jittered
    exponential backoff (:data:`REQUEST_FIRST_WAIT_S` doubling up to :data:`REQUEST_MAX_WAIT_S`).

    ``give_up()`` true stops at the next failure (an upload being aborted). ``asynchronous``: a
    :class:`tenacity.AsyncRetrying` for coroutine functions, sleeping on the running event loop. The last
    exception is re-raised unchanged.
    """
    def worth_it(exc: BaseException) -> bool:
        return is_transient(exc) and not (give_up is not None and give_up())

    kwargs = {
        "stop": tenacity.stop_after_attempt(max(1, attempts)),
        "wait": tenacity.wait_exponential_jitter(multiplier=REQUEST_FIRST_WAIT_S, max=REQUEST_MAX_WAIT_S,
                                                 jitter=REQUEST_FIRST_WAIT_S),
        "retry": tenacity.retry_if_exception(worth_it),
        "before_sleep": _before_sleep(on_retry),
        "reraise": True,
    }
    return tenacity.AsyncRetrying(**kwargs) if asynchronous else tenacity.Retrying(**kwargs)


def repeat_on(exc_type: type[BaseException] | tuple[type[BaseException], ...], attempts: int,
              asynchronous: bool = False) -> tenacity.Retrying | tenacity.AsyncRetrying:
    """Call again at once when ``exc_type`` is raised, ``attempts`` times in all (a blob replaced while it was
    being read is read again); the last exception is re-raised unchanged."""
    kwargs = {"stop": tenacity.stop_after_attempt(attempts), "retry": tenacity.retry_if_exception_type(exc_type),
              "reraise": True}
    return tenacity.AsyncRetrying(**kwargs) if asynchronous else tenacity.Retrying(**kwargs)


def _before_sleep(on_retry: Callable[[int, BaseException, float], None] | None
                  ) -> Callable[[tenacity.RetryCallState], None] | None:
    if on_retry is None:
        return None

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if state.outcome is not None:
            sleep = state.next_action.sleep if state.next_action else 0.0
            on_retry(state.attempt_number, state.outcome.exception(), sleep)

    return before_sleep
