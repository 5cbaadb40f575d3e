"""How the one S3 client (`s3_client.py`, serving the team cache in `store/remote/s3.py` and bucket
data sources in `bucket.py`) is configured: where it may send requests, which credentials it may
look for, how long it waits, and the size of the pieces it streams. Imports no obstore, so these
rules are tested without a server, and messages name the endpoint without loading the client.

Two rules, both failing closed:
- Traffic goes to the configured endpoint only. With no credentials in the environment, the S3
  client's default chain asks the cloud instance metadata service (169.254.169.254) for them, on
  any machine; buildtrain stops first with one line naming the variables to set, unless the user
  asks for this machine's instance role with `BT_S3_INSTANCE_CREDENTIALS=1`.
- A server that accepts a connection and never answers fails a command within about 10 s: each
  wait (connect, or the next byte of a response) is bounded, and so are the retries. The client's
  defaults (30 s a try, retried for 3 minutes) stalled each command 181 s with no output.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

INSTANCE_CREDENTIALS = "BT_S3_INSTANCE_CREDENTIALS"
CHUNK = 8 << 20  # streamed downloads arrive in pieces this large (8 MB: fewer Python round trips)


# Any one of these is a credential the client takes without asking the metadata service: static
# keys (a lone one is an error the client reports), a web identity, a container's credentials
# endpoint (named by the user's platform), or unsigned requests to a public bucket.
EXPLICIT = (
    ("AWS_ACCESS_KEY_ID",),
    ("AWS_SECRET_ACCESS_KEY",),
    ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"),
    ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",),
    ("AWS_CONTAINER_CREDENTIALS_FULL_URI",),
)
TRUE = ("1", "true", "yes")
USERINFO = re.compile(r"(?<=://)[^/\s@]*@")

# A silent server: 5 s a try, then one more try, and no try starts 10 s after the first.
# A response's next byte may take 5 s (reqwest's read timeout resets on each read, so a long
# download is not cut short); 5xx answers are still retried, up to 3 times within those 10 s.
CLIENT_OPTIONS: dict[str, Any] = {"connect_timeout": "5s", "read_timeout": "5s"}
RETRY: dict[str, Any] = {"max_retries": 3, "retry_timeout": timedelta(seconds=10)}


def endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL", "")


def shown_endpoint() -> str:
    """The endpoint as messages print it: without any user:password, 'AWS' when unset."""
    return redact(endpoint()) or "AWS"


def redact(text: str) -> str:
    """`text` without the user:password any URL in it may carry (`http://u:p@host` ->
    `http://***@host`): an endpoint, or a client's message that repeats it."""
    return USERINFO.sub("***@", text)


def instance_credentials_asked() -> bool:
    return os.environ.get(INSTANCE_CREDENTIALS, "").strip().lower() in TRUE


def has_credentials() -> bool:
    """Whether the client can sign (or skip signing) without asking the instance metadata service."""
    if os.environ.get("AWS_SKIP_SIGNATURE", "").strip().lower() in TRUE:
        return True
    return any(all(os.environ.get(name) for name in names) for names in EXPLICIT)


def credentials_problem() -> str | None:
    """Why no client may be built here, or None: no credentials, and no instance role asked for."""
    if has_credentials() or instance_credentials_asked():
        return None
    return (
        "no AWS credentials in the environment; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        f"(and AWS_REGION), or {INSTANCE_CREDENTIALS}=1 to use this machine's instance role"
    )


def store_options() -> dict[str, Any]:
    """The keyword arguments of every `S3Store` buildtrain builds (beyond bucket and prefix)."""
    return {
        "client_options": {**CLIENT_OPTIONS, "allow_http": endpoint().startswith("http://")},
        "retry_config": dict(RETRY),
    }
