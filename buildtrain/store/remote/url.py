"""Where a remote is: `s3://bucket/prefix` (S3-compatible object storage) or `file:///path` (a
folder every machine mounts). A remote's location is never part of any hash: it says where
results live, not what they are."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Literal

import attrs

from buildtrain.errors import UsageError
from buildtrain.sources.data_url import BUCKET

# One segment of a prefix: the characters S3 documents as safe in keys, no "." or ".." segment.
SEGMENT = re.compile(r"^[A-Za-z0-9!_.*'()-]+$")
SCHEMES = ("s3", "file")


def _check_prefix(_: object, __: attrs.Attribute, value: str) -> None:
    if value and not all(SEGMENT.match(part) and part not in {".", ".."} for part in value.split("/")):
        raise ValueError(
            f"prefix {value!r}: use segments of letters, digits and !_.*'()- separated by single '/'"
        )


def _check_location(instance: RemoteUrl, _: attrs.Attribute, value: str) -> None:
    if instance.scheme == "s3" and not BUCKET.match(value):
        raise ValueError(f"bucket {value!r}: 3-63 lower-case letters, digits, '.' and '-'")
    if instance.scheme == "file" and not (value.startswith("/") and PurePosixPath(value).is_absolute()):
        raise ValueError(f"path {value!r}: a file:// remote needs an absolute path (file:///mnt/team/bt)")
    if instance.scheme == "file" and value == "/":
        raise ValueError(
            "the root of the file system is never a remote: give its folder (file:///mnt/team/bt)"
        )


@attrs.frozen(kw_only=True)
class RemoteUrl:
    """A parsed remote location; `str()` gives back the canonical URL."""

    scheme: Literal["s3", "file"] = attrs.field(validator=attrs.validators.in_(SCHEMES))
    location: str = attrs.field(validator=_check_location)
    """The bucket (s3) or the absolute folder (file)."""
    prefix: str = attrs.field(default="", validator=_check_prefix)
    """Where under the bucket the objects live (s3 only; '' for the whole bucket)."""

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.location}"
        return f"s3://{self.location}/{self.prefix}" if self.prefix else f"s3://{self.location}"


def parse_url(text: str) -> RemoteUrl:
    """`s3://bucket[/prefix]` or `file:///absolute/path`; UsageError (exit 2) naming the fix."""
    scheme, sep, rest = text.partition("://")
    try:
        if sep and scheme == "s3":
            bucket, _, prefix = rest.partition("/")
            return RemoteUrl(scheme="s3", location=bucket, prefix=prefix.strip("/"))
        if sep and scheme == "file":
            folder = rest.rstrip("/")
            if not folder:  # `file://$UNSET` would push into the file system's root
                raise ValueError(
                    "no folder (an unset variable?); the root of the file system is never a remote: "
                    "give its folder (file:///mnt/team/bt)"
                )
            if "//" in folder or any(part in {".", ".."} for part in folder.split("/")):
                raise ValueError(f"path {folder!r}: give a plain absolute path, without '.', '..' or '//'")
            return RemoteUrl(scheme="file", location=folder)
    except ValueError as exc:
        raise UsageError(f"remote {text!r}: {exc}") from None
    raise UsageError(f"remote {text!r}: use s3://bucket/prefix or file:///absolute/path")
