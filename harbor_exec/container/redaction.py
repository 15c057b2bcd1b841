"""One secret scrubber for every place a secret could be written.

A secret shorter than ``MIN_SECRET_LEN`` is not scrubbed: replacing every
occurrence of a short string would mangle ordinary text, and no real API key is
that short. Standard library only: the container runner uses it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Final

REDACTED: Final = "[REDACTED]"
MIN_SECRET_LEN: Final = 8


def needles(secrets: Iterable[str | None]) -> list[str]:
    """The secrets worth scrubbing, longest first (a secret may contain another)."""
    found = {s for s in secrets if s and len(s) >= MIN_SECRET_LEN}
    return sorted(found, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every secret replaced by ``[REDACTED]``."""
    for needle in needles(secrets):
        if needle in text:
            text = text.replace(needle, REDACTED)
    return text


def scrub_tree(root: Path, secrets: Iterable[str | None]) -> None:
    """Scrub every regular file under ``root`` in place.

    A file that cannot be rewritten is deleted: a secret must never stay on disk.
    """
    encoded = [(n.encode(), REDACTED.encode()) for n in needles(secrets)]
    if not encoded or not root.exists():
        return
    for path in root.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        try:
            data = scrubbed = path.read_bytes()
            for needle, replacement in encoded:
                scrubbed = scrubbed.replace(needle, replacement)
            if scrubbed != data:
                path.write_bytes(scrubbed)
        except OSError:
            path.unlink(missing_ok=True)


__all__ = ["MIN_SECRET_LEN", "REDACTED", "needles", "redact", "scrub_tree"]
