"""Text from another process, made safe to write anywhere (files, JSON, OTLP protobuf).

Text read from a process (argv and titles, thread, function and file names) is bytes the process
chose; Python decodes it with ``surrogateescape``, and one lone surrogate makes every UTF-8 writer
raise (``UnicodeEncodeError``), which loses the evidence around it. :func:`safe_text` turns such
bytes into ``\\xNN`` escapes once, where the text enters servewatch. Stdlib only.
"""

from __future__ import annotations

__all__ = ["safe_text"]


def safe_text(text: str) -> str:
    """``text`` with lone surrogates (undecodable bytes) written as ``\\xNN`` escapes.

    Valid text is returned unchanged (the same object); the result always encodes as UTF-8.
    ``"sched\\udcff_TP0"`` (argv bytes ``sched\\xff_TP0``) becomes ``"sched\\\\xff_TP0"``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        escapes_only = all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)
        raw = text.encode("utf-8", "surrogateescape" if escapes_only else "surrogatepass")
        return raw.decode("utf-8", "backslashreplace")
    return text
