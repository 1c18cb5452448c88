"""Secrets out of anything a report shows: command lines, environments, URLs, free text.

Reports get forwarded to whole teams, so a token in a server's command line (`--api-key sk-...`), an environment
dump (`HF_TOKEN=hf_...`) or a URL with credentials (`https://user:pass@host`) must never reach one. Redaction is by
name (flags, variables and query parameters whose name says secret) and by shape (well-known token formats), and is
idempotent: redacting twice gives the same text. Control characters (terminal escape sequences) come out as visible
escapes (diagnoser/textsafe.py), so whatever a report shows cannot drive the terminal it is shown on.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from enum import Enum
from typing import TypeVar, cast

from diagnoser.textsafe import printable

MASK = "[redacted]"

# Name parts that mark a flag, variable or query parameter as secret. Parts, not substrings: "--max-num-batched-
# tokens" and "--tokenizer" are not secrets, "--hf-token" and "OPENAI_API_KEY" are.
_SECRET_PARTS = frozenset({
    "key", "apikey", "token", "secret", "secrets", "password", "passwd", "pass", "pwd", "passphrase", "auth",
    "authorization", "credential", "credentials", "cookie", "session", "signature", "sig", "bearer", "jwt",
    "privatekey", "accesskey", "secretkey", "clientsecret", "dsn",
})
# Whole names (squashed: lower case, no separators) that are secret although no single part is.
_SECRET_NAMES = frozenset({"apikey", "accesstoken", "refreshtoken", "idtoken", "authtoken", "hftoken",
                           "xapikey", "xamzsignature", "xamzcredential", "xamzsecuritytoken"})

# A last name part that makes the value a quantity, whatever came before ("token" in vLLM's
# --long-prefill-token-threshold names what is counted, not a credential).
_QUANTITY_TAILS = frozenset({"threshold", "limit", "size", "len", "length", "count", "budget", "ratio", "max", "min"})

# Token formats recognisable on their own, wherever they appear.
_TOKEN_SHAPES = re.compile(
    r"""(?x)
    \b(?:
        sk-(?:proj-|ant-)?[A-Za-z0-9_\-]{8,}       # OpenAI / Anthropic style keys
      | hf_[A-Za-z0-9]{20,}                        # Hugging Face tokens (34 characters; not hf_generate.py)
      | gh[pousr]_[A-Za-z0-9]{16,}                 # GitHub tokens
      | github_pat_[A-Za-z0-9_]{16,}
      | glpat-[A-Za-z0-9_\-]{16,}                  # GitLab
      | xox[abposr]-[A-Za-z0-9\-]{8,}              # Slack
      | (?:AKIA|ASIA)[0-9A-Z]{16}                  # AWS access key ids
      | AIza[0-9A-Za-z_\-]{30,}                    # Google API keys
      | eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*   # JWTs
    )"""
)
# Linear time (a report line can be anything a process or endpoint wrote, 'a.' * 100000 included): a pattern that
# scans a run of name characters from each of its starts is quadratic in the run, so every pattern below starts only
# where a run starts and consumes the whole run whether or not it is followed by what makes a secret (the optional
# tail); a run that turns out not to be one is given back unchanged. Where the old patterns began inside a run
# (after a '.'), every start in the run had the same tail, so they matched where the first start did.
#
# user:password@ (or a lone token@) in a URL: everything between "//" and "@" goes. The scheme starts at a word
# boundary and a letter somewhere in the run before "://" (_SCHEME_START finds where).
_URL_USERINFO = re.compile(r"(?i)(?<![a-z0-9+.\-])([a-z0-9+.\-]+)://[^/\s@?#]+@")
_SCHEME_START = re.compile(r"(?i)\b[a-z]")
# ?name=value / &name=value in a URL; the "=value" is optional so that a name without one is consumed in one go.
_QUERY_PARAM = re.compile(r"([?&;])([^=&#\s]+)(?:=([^&#\s]*))?")
# "Authorization: Bearer X", "Authorization: Basic X", a lone "Bearer X". Not a bare "token X": prose says
# "token generation".
_AUTH_HEADER = re.compile(r"(?i)(\bauthorization:\s*(?:bearer\s+|basic\s+|token\s+)?|\bbearer\s+)"
                          r"(?!\[redacted\])([A-Za-z0-9._~+/=\-]{8,})")
_AUTH_SCHEMES = ("bearer", "basic", "token")
# "api_key": "value" in JSON or Python reprs.
_QUOTED_PAIR = re.compile(r"""(["'])([A-Za-z_][\w.\-]*)\1(\s*[:=]\s*)("[^"]*"|'[^']*'|[^\s,}\]]+)""")
# --flag=value, -flag=value, NAME=value, name: value (in free text; values up to whitespace or a quote).
# The separator and value are optional (a plain word is consumed whole; see above).
_ASSIGNMENT = re.compile(r"""(?<![\w\-])(-{0,2}[A-Za-z_][\w.\-]*)(?:(=|:\s*)("[^"]*"|'[^']*'|[^\s"',;]+))?""")
# --flag value (a separate word), in free text; the value is optional as above.
_FLAG_SPACE_VALUE = re.compile(r"""(?<![\w\-])(--?[A-Za-z][\w.\-]*)(?:(\s+)("[^"]*"|'[^']*'|[^\s"'\-][^\s"']*))?""")


def _name_parts(name: str) -> list[str]:
    return [p for p in re.split(r"[^a-z0-9]+", name.lower().lstrip("-")) if p]


def is_secret_name(name: str) -> bool:
    """Whether a flag, environment variable or parameter name says its value is a secret."""
    parts = _name_parts(name)
    if not parts or parts[-1] in _QUANTITY_TAILS:  # "--long-prefill-token-threshold 512" is a number of tokens
        return False
    if "".join(parts) in _SECRET_NAMES:
        return True
    # "api_key", "secret-access-key", "x-api-key": also check adjacent pairs ("api"+"key" -> "apikey").
    pairs = {a + b for a, b in zip(parts, parts[1:], strict=False)}
    return any(p in _SECRET_PARTS for p in parts) or bool(pairs & (_SECRET_NAMES | _SECRET_PARTS))


def _mask_value(value: str) -> str:
    if value.startswith(("'", '"')) and len(value) >= 2 and value[-1] == value[0]:
        return value[0] + MASK + value[0]
    return MASK


# Single words that are secrets even in "word: value" prose form; "token: 12 ms" is prose, "password: x" is not.
_STRONG_WORDS = frozenset({"password", "passwd", "pwd", "secret", "apikey", "passphrase", "credentials"})


def _assignment(m: re.Match[str]) -> str:
    name, sep, value = m.group(1), m.group(2), m.group(3)
    if sep is None or not is_secret_name(name) or value == MASK or value.lower() in _AUTH_SCHEMES:
        return m.group(0)
    parts = _name_parts(name)
    if sep.startswith(":") and not name.startswith("-") and len(parts) < 2 and parts[0] not in _STRONG_WORDS:
        return m.group(0)
    return f"{name}{sep}{_mask_value(value)}"


def _url_userinfo(m: re.Match[str]) -> str:
    # The scheme begins at the first letter of the run that starts a word ("x.https" -> "x." and "https"); the run
    # before "://" may hold none ("_1://"), and then it is no URL.
    start = _SCHEME_START.search(m.string, m.start(1), m.end(1))
    if start is None:
        return m.group(0)
    return f"{m.string[m.start(1):m.end(1)]}://{MASK}@"


def redact(text: str) -> str:
    """The text with secrets replaced by [redacted]: URL credentials and secret query parameters, secret-named
    flags and variables (`--api-key X`, `--token=X`, `HF_TOKEN=X`), auth headers, and well-known token shapes."""
    if not text:
        return text
    # Every report line passes here: control characters (terminal escapes) are shown, never sent (textsafe.py).
    out = _URL_USERINFO.sub(_url_userinfo, text)
    out = _AUTH_HEADER.sub(lambda m: f"{m.group(1)}{MASK}", out)  # before "name: value" takes "Bearer"
    out = _QUERY_PARAM.sub(lambda m: f"{m.group(1)}{m.group(2)}={MASK}" if m.group(3) is not None
                           and is_secret_name(m.group(2)) and m.group(3) != MASK else m.group(0), out)
    out = _ASSIGNMENT.sub(_assignment, out)
    out = _FLAG_SPACE_VALUE.sub(lambda m: f"{m.group(1)}{m.group(2)}{_mask_value(m.group(3))}"
                                if m.group(3) is not None and is_secret_name(m.group(1)) and m.group(3) != MASK
                                else m.group(0), out)
    out = _QUOTED_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{_mask_value(m.group(4))}"
                           if is_secret_name(m.group(2)) else m.group(0), out)
    return printable(_TOKEN_SHAPES.sub(MASK, out))


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line with secrets masked, word by word: the value after a secret flag (`--api-key X`) goes too."""
    out: list[str] = []
    mask_next = False
    for word in argv:
        if mask_next and not word.startswith("-"):
            out.append(MASK)
            mask_next = False
            continue
        mask_next = False
        if word.startswith("-") and "=" not in word and is_secret_name(word):
            mask_next = True
            out.append(word)
            continue
        out.append(redact(word))
    return out


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """An environment with secret-named variables masked and secrets in the other values redacted."""
    return {k: MASK if is_secret_name(k) else redact(v) for k, v in env.items()}


def redact_obj(obj: object) -> object:
    """Every string in a JSON-like structure (dicts, lists, tuples) redacted; other values as they are."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj


_V = TypeVar("_V")


def redact_fields(view: _V) -> _V:
    """A copy of a view with every string in it redacted, however deep: dataclass fields, lists, tuples and dict
    values (enums, numbers and arrays as they are). The report model redacts a figure's data with it once, labels
    and tooltips included, so that the renderers that draw it never redact."""
    return cast(_V, _redacted(view))


def _redacted(obj: object) -> object:
    if isinstance(obj, Enum):
        return obj  # a str enum is a key, not text
    if isinstance(obj, str):
        return redact(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _redacted(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        if all(type(v) in (float, int) for v in obj):
            return obj  # a series' points: nothing to redact, and no copy of thousands of numbers
        items = [_redacted(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {redact(k) if isinstance(k, str) else k: _redacted(v) for k, v in obj.items()}
    return obj
