"""The one S3 client (`sources/s3_client.py`): bucket data sources and the team cache build it the
same way and sort its failures the same way, into one-line errors (exit 1) that name the caller's
subject and what it was doing. No server here: the sorting is read from the client's own words."""

from __future__ import annotations

import pytest

pytest.importorskip("obstore")

from obstore.exceptions import GenericError, PermissionDeniedError

from buildtrain.sources import s3_client
from buildtrain.sources.s3_client import Problem, sort, unavailable

SILENT = (
    "Generic S3 error: Error performing HEAD http://127.0.0.1:1/b/k in 10.1s, after 1 retries, "
    "max_retries: 3, retry_timeout: 10s  - HTTP error: error sending request\n\nDebug source:\n"
    "inner: Http(HttpError { kind: Timeout, source: reqwest::Error { kind: Request, source: TimedOut } })"
)
REFUSED_CONNECTION = (
    "Generic S3 error: Error performing GET http://127.0.0.1:1/b in 431ms, after 3 retries, "
    "max_retries: 3, retry_timeout: 10s  - HTTP error: error sending request\n\nDebug source:\n"
    "inner: Http(HttpError { kind: Request, source: hyper_util::client::legacy::Error(Connect, "
    'ConnectError("tcp connect error", Os { code: 111, kind: ConnectionRefused })) })'
)


@pytest.mark.parametrize(
    ("exc", "problem", "words"),
    [
        (
            GenericError("Error performing list request: NoSuchBucket: The bucket does not exist"),
            Problem.NO_BUCKET,
            "there is no bucket 'bt-data' at",
        ),
        (PermissionDeniedError("Access Denied"), Problem.DENIED, "no usable credentials for the bucket"),
        (GenericError("InvalidAccessKeyId: no such key"), Problem.DENIED, "AWS_ACCESS_KEY_ID"),
        (GenericError(SILENT), Problem.TIMED_OUT, "did not answer in time"),
        (GenericError(REFUSED_CONNECTION), Problem.UNREACHABLE, "cannot reach the S3 endpoint"),
        (GenericError("SlowDown: please reduce your request rate"), Problem.REFUSED, "refused the request"),
    ],
)
def test_each_failure_is_sorted_once_into_one_line_naming_the_caller(
    exc: Exception, problem: Problem, words: str
) -> None:
    assert sort(exc) is problem
    for subject, doing in (
        ("s3://bt-data/corpus.jsonl", ""),
        ("remote s3://bt-data/team", "failed to list plans"),
    ):
        error = unavailable(subject, "bt-data", exc, doing)
        line = str(error)
        assert line.startswith(f"{subject}: ") and words in line, line
        assert "\n" not in line and error.exit_code == 1
        assert problem is Problem.NO_BUCKET or doing in line


def test_the_endpoints_credentials_never_reach_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://team:hunter2@127.0.0.1:1")
    line = str(
        unavailable("remote s3://b/x", "b", GenericError(SILENT.replace("127.0.0.1", "team:hunter2@h")))
    )
    assert "hunter2" not in line and "http://***@127.0.0.1:1" in line


def test_data_sources_and_the_team_cache_share_the_client() -> None:
    from buildtrain.sources import bucket
    from buildtrain.store.remote import s3

    assert bucket.S3Client is s3.S3Client is s3_client.S3Client
    assert bucket.NoSuchBucket is s3_client.NoSuchBucket
