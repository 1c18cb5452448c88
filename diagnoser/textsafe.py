"""Untrusted text made safe for terminals and logs: control characters shown, never obeyed.

A process's command line, a metric label (dcgm-exporter's modelName), a process or thread name, an error from an
endpoint: any of these can carry ESC, and a terminal that receives "ESC [2J" clears the screen, "ESC ]52;c;..." writes
the clipboard, "ESC ]8;;URL" plants a link. Piped output is no safer: it is read later with `less -R`, `cat` or a log
viewer. Every C0 control (U+0000-U+001F), DEL (U+007F), C1 control (U+0080-U+009F; U+009B is a one-character CSI)
(U+0085 NEL among them), line and paragraph separator (U+2028, U+2029: a terminal, a log viewer or a JSON-lines
reader may start a new line there, so a name could print a line of its own, a forged verdict) and bidirectional
override (U+202A-U+202E, U+2066-U+2069: text shown in another order than it is) is replaced by its visible escape,
`\\x1b`, `\\x9b`, `\\u2028`, `\\u202e`: a reader still sees that something was there, and the output is still one
line per line. `printable` keeps tab and newline (multi-line notes); `one_line` escapes them too (a log line or a
table cell must not become two).

Escaping is idempotent: `printable(printable(s)) == printable(s)`, since the escapes are printable themselves.
"""

from __future__ import annotations

import re

_BIDI = "\u202a-\u202e\u2066-\u2069"
_SEPARATORS = "\u2028\u2029"  # LINE SEPARATOR, PARAGRAPH SEPARATOR (NEL, U+0085, is a C1 control)
_CONTROLS = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_SEPARATORS}{_BIDI}]")
_CONTROLS_ONE_LINE = re.compile(f"[\x00-\x1f\x7f-\x9f{_SEPARATORS}{_BIDI}]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every control character but tab and newline replaced by its visible escape."""
    if not text or not _CONTROLS.search(text):
        return text
    return _CONTROLS.sub(_escape, text)


def one_line(text: str) -> str:
    """`text` with every control character, tab and newline included, replaced by its visible escape."""
    if not text or not _CONTROLS_ONE_LINE.search(text):
        return text
    return _CONTROLS_ONE_LINE.sub(_escape, text)


def has_controls(text: str) -> bool:
    """Whether `text` holds anything `printable` would escape (tests and assertions)."""
    return bool(_CONTROLS.search(text))
