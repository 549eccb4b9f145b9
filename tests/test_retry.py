"""retry.py: the one table of transient failures, and the tenacity policies every retrying layer uses."""

from __future__ import annotations

import asyncio
import errno

import pytest

from tiered_ckpt.errors import CorruptionError, PermanentTierError, TransientTierError
from tiered_ckpt.retry import (
    FULL_ERRNOS,
    PERMANENT_ERRNOS,
    TRANSIENT_ERRNOS,
    is_transient,
    repeat_on,
    request_retrying,
)
from tiered_ckpt.tiers._files import tier_error


@pytest.mark.parametrize("code", sorted(TRANSIENT_ERRNOS), ids=lambda c: errno.errorcode[c])
def test_a_transient_errno_is_transient_for_the_policy_and_for_the_file_tiers_alike(code):
    exc = OSError(code, "x")
    assert is_transient(exc)
    err = tier_error(exc, tier="t", key="k", op="write", path="/p")
    assert isinstance(err, TransientTierError) and is_transient(err)


@pytest.mark.parametrize("code", sorted(PERMANENT_ERRNOS), ids=lambda c: errno.errorcode[c])
def test_a_permanent_errno_is_never_retried(code):
    exc = OSError(code, "x")
    assert not is_transient(exc)
    err = tier_error(exc, tier="t", key="k", op="write", path="/p")
    assert isinstance(err, PermanentTierError) and not is_transient(err)
    assert ("disk full" in str(err)) == (code in FULL_ERRNOS)


def test_corruption_is_never_transient_even_with_a_transient_cause():
    err = CorruptionError("the store's answer timed out mid-header", tier="t", key="k")
    err.__cause__ = TimeoutError("read timed out")
    assert not is_transient(err)


def test_request_retrying_tries_transient_failures_only_and_reports_each_wait():
    calls, waits = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientTierError("SlowDown")
        return "ok"

    policy = request_retrying(3, on_retry=lambda attempt, exc, sleep: waits.append((attempt, sleep)))
    policy.sleep = lambda s: None  # tenacity's own hook: no real waiting in a test
    assert policy(flaky) == "ok" and len(calls) == 3
    assert [a for a, _ in waits] == [1, 2] and all(s > 0 for _, s in waits)

    def denied():
        calls.append(1)
        raise PermanentTierError("AccessDenied")

    calls.clear()
    with pytest.raises(PermanentTierError):
        request_retrying(5)(denied)
    assert len(calls) == 1


def test_async_request_retrying_gives_up_once_told_to():
    calls = []
    stop = [False]

    async def failing():
        calls.append(1)
        stop[0] = True  # an abort started while this try was in flight
        raise TransientTierError("reset")

    with pytest.raises(TransientTierError):
        asyncio.run(request_retrying(5, give_up=lambda: stop[0], asynchronous=True)(failing))
    assert len(calls) == 1


def test_repeat_on_calls_again_at_once_then_reraises():
    class Replaced(Exception):
        pass

    calls = []

    def read():
        calls.append(1)
        raise Replaced()

    with pytest.raises(Replaced):
        repeat_on(Replaced, 3)(read)
    assert len(calls) == 3
