"""Keeping secrets out of what a run prints and writes: commands, configs, logs.

A value is secret when its name says so (`looks_secret`: VLLM_API_KEY, HF_TOKEN, hub_token,
AWS_SECRET_ACCESS_KEY, a password...) or when it is an environment value given to an agent (a
harness `env`: what a user puts there is usually a credential). Secrets are replaced by `REDACTED`,
names kept, so a reader still sees that a key was set. Text that may quote a secret (a log line, a
traceback) has the current values of secret-named environment variables blanked out.
"""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import urlsplit, urlunsplit

REDACTED = "<redacted>"
# The last word of a name: ..._KEY, ..._TOKEN, ..._SECRET, ..._PASSWORD (also with - or . between
# words). `max_tokens` and `token_budget` are not secrets: only the word at the end counts.
_SECRET_NAME = re.compile(
    r"(?:^|[_.-])(?:api[_-]?key|key|token|secret|secret[_-]?key|password|passwd|credentials?)$",
    re.IGNORECASE,
)
# Keys under which a config holds environment variables handed to other programs.
ENVIRONMENT_KEYS = ("env",)
# Shorter values are too likely to occur by chance in a log line to be blanked there.
MIN_SECRET_TEXT_LENGTH = 8


def looks_secret(name: str) -> bool:
    return bool(_SECRET_NAME.search(name.strip().lstrip("-")))


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {name: REDACTED if looks_secret(name) and value else value for name, value in env.items()}


def redact_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of every secret-named flag (`--api-key K`, `--hf-token=T`) blanked."""
    redacted, hide_next = [], False
    for argument in argv:
        if hide_next:
            redacted.append(REDACTED)
            hide_next = False
            continue
        flag, equals, _ = argument.partition("=")
        if argument.startswith("--") and looks_secret(flag):
            if equals:
                argument = f"{flag}={REDACTED}"
            else:
                hide_next = True
        redacted.append(argument)
    return redacted


def redact_url(url: str) -> str:
    """A URL with the password of its user info (`http://user:pass@host`) blanked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:{REDACTED}@{host}"))


def redact_config(value):
    """A copy of a config (dicts, lists, scalars) with secrets blanked: values under secret-named
    keys, every value of an `env` mapping, and passwords inside URLs."""
    if isinstance(value, dict):
        copy = {}
        for key, item in value.items():
            if isinstance(key, str) and key in ENVIRONMENT_KEYS and isinstance(item, dict):
                copy[key] = {name: REDACTED for name in item}
            elif isinstance(key, str) and looks_secret(key) and item not in (None, "", [], {}):
                copy[key] = REDACTED
            else:
                copy[key] = redact_config(item)
        return copy
    if isinstance(value, (list, tuple)):
        return [redact_config(item) for item in value]
    if isinstance(value, str) and "@" in value and "://" in value:
        return redact_url(value)
    return value


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """The values of the secret-named environment variables, longest first."""
    environ = os.environ if environ is None else environ
    values = {
        value
        for name, value in environ.items()
        if looks_secret(name) and len(value) >= MIN_SECRET_TEXT_LENGTH
    }
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, environ: dict[str, str] | None = None) -> str:
    for value in secret_values(environ):
        text = text.replace(value, REDACTED)
    return text


class RedactingFormatter(logging.Formatter):
    """A formatter whose lines (message, traceback and all) never show a secret environment value."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))
