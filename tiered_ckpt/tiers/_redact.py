"""Keeping credentials out of text: :func:`redact` and the helpers that find the secrets of a tier's storage
options and of the AWS environment (used by :mod:`tiered_ckpt.tiers.fsspec_tier`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

# ----- redaction -------------------------------------------------------------------------------------------
REDACTED = "***"
# Option names (at any depth: options, client_kwargs, config_kwargs) whose values are credentials.
SECRET_OPTION_NAMES = frozenset({
    "key", "secret", "token", "password", "username", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token", "session_token", "access_key", "secret_key", "account_key", "sas_token",
    "connection_string", "client_secret", "credentials",
})
SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_MIN_SECRET_LEN = 4  # shorter values would blank out ordinary words; real credentials are 16+ characters
_URL_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@'\"]+@")
_QUERY_SECRET = re.compile(
    r"(?i)\b(X-Amz-Credential|X-Amz-Signature|X-Amz-Security-Token|AWSAccessKeyId|Signature|sig)=[^&\s'\"]+")
_AUTH_HEADER = re.compile(r"(?i)\b(authorization['\"]?\s*[:=]\s*['\"]?)[^'\"\r\n]+")
_NAMED_SECRET = re.compile(
    r"(?i)(['\"]?\b(?:aws_access_key_id|aws_secret_access_key|aws_session_token|secret|password|token)"
    r"['\"]?\s*[:=]\s*['\"]?)[^'\"\s,;}&]+")


def secret_values(options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> set[str]:
    """Every credential in ``options`` (nested mappings included) and in the AWS environment variables."""
    found: set[str] = set()

    def walk(mapping: Mapping[str, Any]) -> None:
        for name, value in mapping.items():
            if isinstance(value, Mapping):
                walk(value)
            elif isinstance(value, str) and str(name).lower() in SECRET_OPTION_NAMES:
                found.add(value)

    walk(options or {})
    env = os.environ if env is None else env
    found.update(env[name] for name in SECRET_ENV_VARS if env.get(name))
    return {s for s in found if len(s) >= _MIN_SECRET_LEN}


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without credentials: the given secret values, URL user info (``scheme://user:pw@``),
    signed-URL parameters, ``Authorization`` headers and ``secret=...``-style pairs become ``***``."""
    text = str(text)
    for value in sorted(set(secrets), key=len, reverse=True):
        if len(value) >= _MIN_SECRET_LEN:
            text = text.replace(value, REDACTED)
    text = _URL_USERINFO.sub(rf"\1{REDACTED}@", text)
    text = _QUERY_SECRET.sub(rf"\1={REDACTED}", text)
    text = _AUTH_HEADER.sub(rf"\1{REDACTED}", text)
    return _NAMED_SECRET.sub(rf"\1{REDACTED}", text)


def redacted_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of storage options with every credential value replaced by ``***`` (for display)."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            out[name] = redacted_options(value)
        elif str(name).lower() in SECRET_OPTION_NAMES and value is not None:
            out[name] = REDACTED
        elif isinstance(value, str):
            out[name] = redact(value)
        else:
            out[name] = value
    return out
