"""Data files in a bucket, as a preset names them: `s3://bucket/key`, or a glob over keys such as
`s3://bucket/corpus/*.jsonl` (`*` and `?` within one '/'-separated segment, `[abc]`, and `**` for
any number of segments, as a local glob reads them). Imports nothing heavy: the preset loader and
`bt plan` recognise these URLs without loading the S3 client.

Where an object lives never enters a hash: a data file is planned by its content alone (its
blake3 and size), so the same bytes on disk and in a bucket plan to the same step hash.
"""

from __future__ import annotations

import fnmatch
import re

import attrs

# S3 bucket names: 3-63 lower-case letters, digits, dots and hyphens, starting and ending alnum.
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
SCHEME = "s3://"
GLOB_CHARACTERS = frozenset("*?[")


def is_object_url(text: object) -> bool:
    """Whether a `data.files` entry names objects in a bucket rather than local files."""
    return isinstance(text, str) and text.startswith(SCHEME)


def _check_bucket(_: object, __: attrs.Attribute[str], value: str) -> None:
    if not BUCKET.match(value):
        raise ValueError(f"bucket {value!r}: 3-63 lower-case letters, digits, '.' and '-'")


def _check_key(_: object, __: attrs.Attribute[str], value: str) -> None:
    if not value or value.startswith("/") or value.endswith("/"):
        raise ValueError("name an object or a glob after the bucket, as in s3://bucket/corpus/*.jsonl")
    if any(part in {"", ".", ".."} for part in value.split("/")):
        raise ValueError(f"key {value!r}: no empty, '.' or '..' segment (no '//')")


@attrs.frozen(kw_only=True)
class ObjectUrl:
    """One `s3://` entry of `data.files`: a key, or a glob over keys, in one bucket."""

    bucket: str = attrs.field(validator=_check_bucket)
    key: str = attrs.field(validator=_check_key)
    """The object's key, or a glob over keys."""

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @property
    def is_glob(self) -> bool:
        return any(char in GLOB_CHARACTERS for char in self.key)

    def listing_prefix(self) -> str:
        """The folder-like prefix every match lies under: the segments before the first glob."""
        literal = []
        for part in self.key.split("/"):
            if any(char in GLOB_CHARACTERS for char in part):
                break
            literal.append(part)
        return "/".join(literal)

    def matches(self, key: str) -> bool:
        """Whether `key` is matched by this glob (segment by segment, as a local glob)."""
        return _match(self.key.split("/"), key.split("/"))

    def at(self, key: str) -> str:
        """The URL of the object `key` in this bucket."""
        return f"{SCHEME}{self.bucket}/{key}"


def _match(pattern: list[str], parts: list[str]) -> bool:
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":  # any number of segments (none included), but no hidden one, as on disk
        visible = next((i for i, part in enumerate(parts) if part.startswith(".")), len(parts))
        return any(_match(rest, parts[skip:]) for skip in range(visible + 1))
    if not parts or (parts[0].startswith(".") and not head.startswith(".")):
        return False  # a hidden name is matched only by a pattern that names the dot, as on disk
    return fnmatch.fnmatchcase(parts[0], head) and _match(rest, parts[1:])


def parse_object_url(text: str) -> ObjectUrl:
    """`s3://bucket/key-or-glob`; ValueError with the fix when it is not one."""
    if not is_object_url(text):
        raise ValueError(f"{text!r} is not an s3:// URL")
    bucket, _, key = text[len(SCHEME) :].partition("/")
    return ObjectUrl(bucket=bucket, key=key)


@attrs.frozen(kw_only=True)
class ObjectVersion:
    """What a bucket says of one object: enough to tell, without reading it, that it is the
    version already hashed. Only ever a hint that saves a download, never a digest."""

    url: str
    etag: str
    size: int = attrs.field(validator=attrs.validators.ge(0))
    modified: str
    """Last-modified time as the server reported it (ISO 8601)."""
