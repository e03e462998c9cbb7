"""A PDF's text through pypdf, within budgets, with one error for every file it cannot read.

pypdf parses files written by anyone: on a damaged one it raises its own PyPdfError, or, for other damage, an
AttributeError, TypeError, AssertionError ... (`PDF_DAMAGE`); `pdf_text` turns each into `UnreadablePdf`, so
one bad file costs that file (search skips it, page_qa says unsupported_media), never the server. And a PDF can
be made slow to read (4 MB of text operators on one page took 10 s), while the thread reading it stays busy
after its call's deadline (subagents/workers.py): `PdfBudget` bounds the pages, characters and seconds read.
"""

from __future__ import annotations

import io
import logging
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import pypdf
from pypdf import PageObject
from pypdf.errors import FileNotDecryptedError, PyPdfError

logger = logging.getLogger(__name__)

# What pypdf raises on a damaged file besides its own PyPdfError: 4 bytes changed in a trailer give an
# AttributeError, other damage a TypeError, KeyError, AssertionError or RecursionError (a RuntimeError); the
# fuzz test in tests/test_search.py finds them. Named, not `Exception`: a MemoryError or an OSError is the
# process's trouble, not the file's.
PDF_DAMAGE: tuple[type[Exception], ...] = (
    PyPdfError, ArithmeticError, AssertionError, AttributeError, EOFError, LookupError, RuntimeError, TypeError,
    ValueError, struct.error, zlib.error,
)  # fmt: skip


@dataclass(frozen=True)
class PdfBudget:
    """How much of a PDF one extraction reads: a thread busy past its call's deadline stays busy until its work
    returns (subagents/workers.py), so the work itself must end. Checked before each page, and the time also
    between a page's operators; the text read so far is kept and the cut logged. Limit: a page's form XObjects
    are parsed unchecked, each within pypdf's own cap (75 MB decompressed, ~20 s to parse)."""

    pages: int = 1_000
    """A thick book; a 5 MB file (the cap) can hold ~25,000 near-empty pages, each costing its parse."""
    chars: int = 2_000_000
    """20 times page_qa's max_page_chars; search indexes whole documents, and a 1,000-page book is ~2 M."""
    seconds: float = 5.0
    """A 30-page paper takes ~0.15 s; past 5 s a PDF is built to be slow, and a documents thread is freed
    within this plus one content stream's parse, well inside a page_qa call's deadline."""
    content_bytes: int = 5_000_000
    """A page's decompressed content stream past this is not parsed: parsing cannot be stopped midway and takes
    ~0.3 s a MB, and 100 kB of zlib inflate to 30 MB (9 s). 5 MB (1.5 s) is the file cap: no real page needs more."""


class UnreadablePdf(ValueError):
    """A PDF pypdf cannot read; `reason` says why in two words ("damaged PDF", "password-protected PDF")."""

    def __init__(self, exc: Exception) -> None:
        encrypted = isinstance(exc, FileNotDecryptedError)
        self.reason = "password-protected PDF" if encrypted else "damaged PDF"
        super().__init__(f"{self.reason} ({type(exc).__name__}: {str(exc)[:200]})")


def pdf_text(raw: bytes, *, budget: PdfBudget = PdfBudget()) -> tuple[str, str]:
    """A PDF's metadata title ("" when absent or not text) and its pages' text, one page after another, cut
    where `budget` is spent (logged).

    Raises UnreadablePdf, and nothing else, for a file pypdf cannot read (damaged: whatever of PDF_DAMAGE pypdf
    raised; encrypted with a password)."""
    try:
        reader = pypdf.PdfReader(io.BytesIO(raw))
        title = reader.metadata.title if reader.metadata is not None else None
        text = _pages_text(reader.pages, budget)
    except PDF_DAMAGE as exc:
        raise UnreadablePdf(exc) from exc
    return (title if isinstance(title, str) else "").strip(), text


def _pages_text(pages: Sequence[PageObject], budget: PdfBudget) -> str:
    deadline = time.monotonic() + budget.seconds
    texts: list[str] = []
    for number, page in enumerate(pages):
        if cut := _cut(budget, page, pages=number, chars=sum(map(len, texts)), deadline=deadline):
            logger.warning("PDF text cut before page %d of %d: %s", number + 1, len(pages), cut)
            break
        text, whole = _page_text(page, deadline)
        texts.append(text.strip())
        if not whole:
            logger.warning("PDF text cut in page %d of %d: %s", number + 1, len(pages), _spent_time(budget))
            break
    return "\n\n".join(text for text in texts if text)[: budget.chars]


def _cut(budget: PdfBudget, page: PageObject, *, pages: int, chars: int, deadline: float) -> str:
    """Why reading stops before `page` (after `pages` pages and `chars` characters), said for the log; ""
    while `budget` allows it."""
    if pages >= budget.pages:
        return f"its budget of {budget.pages} pages is read"
    if chars >= budget.chars:
        return f"its budget of {budget.chars} characters is read"
    if time.monotonic() > deadline:
        return _spent_time(budget)
    contents = page.get_contents()  # decompressed, not parsed
    size = 0 if contents is None else len(contents.get_data())
    return f"its content is {size} bytes, over {budget.content_bytes}" if size > budget.content_bytes else ""


def _spent_time(budget: PdfBudget) -> str:
    return f"its budget of {budget.seconds:g} s is spent"


class _OutOfTime(BaseException):
    """Raised from pypdf's operator visitor to stop a page whose extraction ran past the PDF's time budget. A
    BaseException, as trio's Cancelled is: pypdf reads a form XObject inside `except Exception`, which would
    swallow it and read on."""


def _page_text(page: PageObject, deadline: float) -> tuple[str, bool]:
    """A page's text and True; once past `deadline`, the text its operators had shown and False. The time is
    checked before each operator: a page can hold millions (4 MB of text operators on one page took 10 s)."""
    shown: list[str] = []

    def check_time(*_: object) -> None:
        if time.monotonic() > deadline:
            raise _OutOfTime

    try:
        text = page.extract_text(
            visitor_operand_before=check_time, visitor_text=lambda text, *_: shown.append(text)
        )
    except _OutOfTime:
        return "".join(shown), False
    return text, True
