"""The retries of boto3's requests (backends/s3.py ``retrying``): which failures are tried
again, on what schedule, and never past the request's time.  No server needed: the
failures are botocore's own exception objects."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from cubefs_fuse.backends.s3 import INITIAL_BACKOFF, MAX_BACKOFF, retrying, worth_retrying


def client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "ListObjectsV2")


def failing(errors: list[Exception]) -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "page"

    return calls, fn


def test_no_answer_5xx_429_and_throttling_codes_are_retried_other_answers_are_not() -> None:
    assert worth_retrying(EndpointConnectionError(endpoint_url="http://x"))
    assert worth_retrying(ReadTimeoutError(endpoint_url="http://x"))
    assert worth_retrying(client_error(503, "SlowDown")) and worth_retrying(client_error(500, "InternalError"))
    assert worth_retrying(client_error(429, "TooManyRequests"))
    assert worth_retrying(client_error(400, "RequestTimeout"))  # S3's 4xx that says "try again"
    assert not worth_retrying(client_error(404, "NoSuchBucket"))
    assert not worth_retrying(client_error(403, "AccessDenied"))
    assert not worth_retrying(ValueError("a bug"))


def test_the_schedule_starts_at_the_initial_backoff_and_grows_with_jitter_up_to_the_maximum() -> None:
    slept: list[float] = []
    calls, fn = failing([client_error(503, "SlowDown")] * 9)
    assert retrying(fn, 10, 3600.0, sleep=slept.append) == "page"
    assert len(calls) == 10 and len(slept) == 9
    initial, most = INITIAL_BACKOFF.total_seconds(), MAX_BACKOFF.total_seconds()
    assert slept[0] == initial
    for before, after in zip(slept, slept[1:]):
        assert initial <= after <= min(most, 2 * before)


def test_retries_end_after_the_count_and_at_once_for_an_answer_not_worth_retrying() -> None:
    calls, fn = failing([client_error(503, "SlowDown")] * 5)
    with pytest.raises(ClientError):
        retrying(fn, 2, 3600.0, sleep=lambda _: None)
    assert len(calls) == 3
    calls, fn = failing([client_error(404, "NoSuchKey")])
    with pytest.raises(ClientError):
        retrying(fn, 10, 3600.0, sleep=lambda _: None)
    assert len(calls) == 1


def test_no_retry_starts_once_its_wait_would_end_past_the_requests_time() -> None:
    """The deadline is what keeps a request given up at backendTimeout from holding its
    worker thread: with 0.3 s, the retries stop within it whatever the count allows."""
    calls, fn = failing([client_error(503, "SlowDown")] * 100)
    started = time.monotonic()
    with pytest.raises(ClientError):
        retrying(fn, 100, 0.3)
    assert time.monotonic() - started < 0.3 + 1.0  # a sleep may overshoot on a loaded machine
    assert 2 <= len(calls) < 100
