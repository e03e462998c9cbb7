"""Local documents: the readable text of HTML, Markdown, plain text and PDF files, and a folder's persistent index.

`read_document` turns one file into a `Document` (title, the URL page_qa opens it with, text);
`extract_page` turns a fetched body into a `PageText` by its media type for page_qa, with the same HTML and PDF
extraction, so a hit reads the same whether it is indexed or opened. `read_folder` extracts every
candidate file of a folder, or, given a `cache_dir`, reuses what it extracted last time while no file changed:

    <cache_dir>/documents.json   {"format", "fingerprint", "folder", "documents": [{title, url, text}, ...]}

The fingerprint is a SHA-256 over (relative path, size, mtime_ns) of every candidate file, so adding, removing,
editing or touching a file re-extracts the whole folder (extraction is the slow part: ~50 ms an HTML page,
more for a long PDF; BM25 indexing of the cached texts takes well under a second per thousand documents).
The file is written atomically (temp file + os.replace): a crash or a concurrent build never leaves a torn one.

A file that cannot be indexed (too big, unreadable, a damaged PDF, no text) costs that file only: it is left
out, named in a warning and in the folder's `skipped` list (stored with the documents), never an error.

Limits: an edit that keeps size and mtime is not seen; a change of extraction code needs `FORMAT` bumped;
PDFs give only what pypdf extracts (no OCR of scanned pages; multi-column layouts may interleave), within
subagents/pdf.py's PdfBudget (pages, characters, seconds).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import trafilatura
from trafilatura.settings import Document as Extracted

from subagents.errors import ToolFailure
from subagents.pdf import UnreadablePdf, pdf_text

logger = logging.getLogger(__name__)

SUFFIXES = frozenset({".html", ".htm", ".txt", ".md", ".pdf"})
HTML_SUFFIXES = frozenset({".html", ".htm"})
# A saved news page is ~0.3 MB, a 30-page paper ~2 MB; the cap equals page_qa's fetch cap (FetchConfig.max_bytes),
# so every indexed file can also be opened.
MAX_FILE_BYTES = 5_000_000
FORMAT = 2  # of documents.json; bump when extraction changes so stale caches are rebuilt (2: skipped files)
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
MARKDOWN_TYPES = frozenset({"text/markdown", "text/x-markdown"})  # read as the same page's HTML would be
PDF_TYPE = "application/pdf"  # what servers send and what file:// URLs of *.pdf are guessed as (mimetypes)
MAX_TITLE_CHARS = 200  # page titles past this are boilerplate-stuffed; the policy needs only a label
SHOWN_SKIPPED = 5  # skipped files named in the index's summary line: it stays one readable line

Progress = Callable[[int, int], None]
"""`progress(done, total)`: called after each file extracted (never on a cache hit)."""
# Codecs Python counts as text encodings that no page is written in: idna, punycode and undefined refuse
# errors="replace" (a UnicodeError, which was an HTTP 500), the escapes read a page's backslashes as code points.
NOT_CHARSETS = frozenset({"idna", "punycode", "undefined", "unicode-escape", "raw-unicode-escape"})


@dataclass(frozen=True)
class Document:
    """One indexed file: its title, the URL page_qa opens it with, and its readable text."""

    title: str
    url: str
    text: str


@dataclass(frozen=True)
class Skipped:
    """A candidate file left out of the index: its path relative to the folder, and why ("damaged PDF")."""

    path: str
    reason: str


def skipped_files(skipped: Sequence[Skipped]) -> str:
    """ "1 file skipped: bad.pdf (damaged PDF)", naming the first SHOWN_SKIPPED (the warnings name them all)."""
    named = ", ".join(f"{s.path} ({s.reason})" for s in skipped[:SHOWN_SKIPPED])
    more = f" and {len(skipped) - SHOWN_SKIPPED} more" if len(skipped) > SHOWN_SKIPPED else ""
    return f"{len(skipped)} file{'s' * (len(skipped) != 1)} skipped: {named}{more}"


def document_paths(folder: Path, max_docs: int, *, roots: Sequence[str] = ()) -> list[Path]:
    """The files of `folder` (recursively) with a readable suffix, in path order, at most `max_docs`.
    Raises PermissionError when the folder itself cannot be listed.

    A file whose real path (symlinks followed) lies outside `folder` and outside every one of `roots` is left
    out with a warning: it is the check page_qa applies before reading, so no snippet quotes a file the server
    may not open (a `leak.txt` linked to /etc/passwd). Limit: a link swapped in after this check is not seen."""
    readable = [folder.resolve(), *(Path(root).resolve() for root in roots)]
    found = sorted(p for p in folder.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())
    paths = [path for path in found if _inside(path, readable)]
    if len(paths) > max_docs:
        logger.warning("search corpus: indexing the first %d of %d files in %s", max_docs, len(paths), folder)
    return paths[:max_docs]


def _inside(path: Path, folders: Sequence[Path]) -> bool:
    if any(path.resolve().is_relative_to(folder) for folder in folders):
        return True
    logger.warning("search corpus: skipping %s (a link to a file outside the allowed file roots)", path)
    return False


def document_url(path: Path, folder: Path, *, base_url: str | None) -> str:
    """`base_url/relative/path` when the folder is served over HTTP, else the file's absolute file:// URL."""
    if base_url is None:
        return path.resolve().as_uri()
    return base_url.rstrip("/") + "/" + quote(path.relative_to(folder).as_posix())


def read_folder(
    folder: Path,
    paths: Sequence[Path],
    *,
    base_url: str | None,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> tuple[list[Document], list[Skipped]]:
    """The documents of `paths` (files under `folder`) and the files skipped: from `cache_dir` when the folder
    is unchanged, else extracted (reporting to `progress`) and, with a `cache_dir`, stored there for next time."""
    key = fingerprint(folder, paths) if cache_dir is not None else ""
    if cache_dir is not None and (cached := load_cached(cache_dir, key)) is not None:
        found = len(cached[0])
        logger.info("search corpus: %d documents of %s from the index at %s", found, folder, cache_dir)
        return cached
    documents, skipped = [], []
    for done, path in enumerate(paths, 1):
        document = read_document(path, url=document_url(path, folder, base_url=base_url))
        if isinstance(document, Document):
            documents.append(document)
        else:
            skipped.append(Skipped(path.relative_to(folder).as_posix(), document))
        if progress is not None:
            progress(done, len(paths))
    if cache_dir is not None:
        save_cached(cache_dir, key, folder=folder, documents=documents, skipped=skipped)
    return documents, skipped


def fingerprint(folder: Path, paths: Sequence[Path]) -> str:
    """SHA-256 over (relative path, size, mtime_ns) of every path: changes whenever a candidate file does."""
    rows = []
    for path in paths:
        status = path.stat()
        rows.append([path.relative_to(folder).as_posix(), status.st_size, status.st_mtime_ns])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def load_cached(cache_dir: Path, key: str) -> tuple[list[Document], list[Skipped]] | None:
    """The documents and skipped files stored under `cache_dir` for fingerprint `key`; None when absent, stale
    or unreadable."""
    try:
        stored = json.loads((cache_dir / "documents.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # unreadable or torn by hand: rebuilt, never trusted
        logger.warning("search corpus: ignoring the index at %s (%s)", cache_dir, exc)
        return None
    if not isinstance(stored, dict) or stored.get("format") != FORMAT or stored.get("fingerprint") != key:
        return None
    return [Document(**row) for row in stored["documents"]], [Skipped(**row) for row in stored["skipped"]]


def save_cached(
    cache_dir: Path, key: str, *, folder: Path, documents: list[Document], skipped: list[Skipped]
) -> None:
    """Store `documents` and `skipped` under `cache_dir` atomically (temp file in the same folder, then
    os.replace)."""
    body: dict[str, Any] = {
        "format": FORMAT, "fingerprint": key, "folder": str(folder.resolve()),
        "documents": [asdict(d) for d in documents], "skipped": [asdict(s) for s in skipped],
    }  # fmt: skip
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=cache_dir, prefix=".documents-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(body, file, ensure_ascii=False)
        os.replace(temp, cache_dir / "documents.json")
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def read_document(path: Path, *, url: str) -> Document | str:
    """Title and text of one file; for a file too big, unreadable, a PDF pypdf cannot read or a file without
    text, why it is skipped (also logged as a warning)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return _skip(path, f"over {MAX_FILE_BYTES} bytes")
        raw = path.read_bytes()
        title, text = _file_text(raw, path.suffix.lower())
    except OSError as exc:
        return _skip(path, f"unreadable: {exc.strerror or exc}")
    except UnreadablePdf as exc:
        return _skip(path, exc.reason, detail=str(exc))
    if not text:
        return _skip(path, "no readable text")
    return Document(title=title or path.stem.replace("_", " "), url=url, text=text)


def _skip(path: Path, reason: str, *, detail: str = "") -> str:
    logger.warning("search corpus: skipping %s (%s)", path, detail or reason)
    return reason


def _file_text(raw: bytes, suffix: str) -> tuple[str, str]:
    if suffix in HTML_SUFFIXES:
        return html_text(raw)
    if suffix == ".pdf":
        return pdf_text(raw)
    return plain_text(raw)


def html_text(raw: bytes | str) -> tuple[str, str]:
    """Title and main text of an HTML file (trafilatura); ("", "") when it has none. Given bytes, trafilatura
    detects their encoding itself. One parse gives text and metadata; the text equals
    trafilatura.extract(output_format="txt")."""
    doc = trafilatura.bare_extraction(raw, output_format="python", include_comments=False, with_metadata=True)
    if doc is None:
        return "", ""
    assert isinstance(doc, Extracted), type(doc)  # as_dict=False returns the Document object
    return doc.title or "", (doc.text or "").strip()


def plain_text(raw: bytes) -> tuple[str, str]:
    """Text files as they are; a Markdown file's leading `# Heading` is its title."""
    text = raw.decode("utf-8", errors="replace").strip()
    first, _, rest = text.partition("\n")
    if first.startswith("# "):
        return first[2:].strip(), rest.strip()
    return "", text


_MD_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
_MD_RULE = re.compile(r"^\s{0,3}(?:[-=*_]\s*){3,}$")  # a setext underline or a thematic break
_MD_FENCE = re.compile(r"^\s{0,3}(?:```|~~~)")
_MD_BULLET = re.compile(r"^(\s*)[*+]\s+")  # written "- " as trafilatura writes an HTML list item
_MD_QUOTE = re.compile(r"^\s{0,3}>\s?")
_MD_ITEM = re.compile(r"^\s*(?:-|\d+[.)])\s+")  # a "- " or numbered list item
_MD_INLINE = (
    (re.compile(r"!\[([^\]]*)\]\([^)]*\)"), r"\1"),  # an image: its alt text
    (re.compile(r"\[([^\]]+)\]\([^)]*\)"), r"\1"),  # a link: its text
    (re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1"), r"\2"),  # strong
    (re.compile(r"(?<![\w*])\*(?=\S)(.+?)(?<=\S)\*(?![\w*])"), r"\1"),  # emphasis
    (re.compile(r"(?<!\w)_(?=\S)(.+?)(?<=\S)_(?!\w)"), r"\1"),
    (re.compile(r"`([^`]+)`"), r"\1"),  # code
)


def markdown_text(text: str) -> tuple[str, str]:
    """Title and readable text of a Markdown page, written as trafilatura writes the same page's HTML: one line
    a block (a paragraph's lines joined, a heading's words without their marks, a list item as "- "), links and
    images as their text, emphasis and code marks dropped, fences and rules left out; a leading `# Heading` is
    also the title. So one page as .md and as .html reads the same. Limits: tables keep their pipes; nested or
    reference-style links and raw HTML are left as written."""
    blocks: list[str] = []
    title, open_paragraph = "", False
    for raw in text.splitlines():
        if not raw.strip() or _MD_FENCE.match(raw) or _MD_RULE.match(raw):
            open_paragraph = False
            continue
        heading = _MD_HEADING.match(raw)
        item = _MD_BULLET.match(raw) or _MD_QUOTE.match(raw) or _MD_ITEM.match(raw)  # each starts a block
        line = heading.group(1) if heading else _MD_BULLET.sub(r"\1- ", _MD_QUOTE.sub("", raw)).strip()
        for pattern, keep in _MD_INLINE:
            line = pattern.sub(keep, line)
        if heading and not blocks and raw.lstrip().startswith("# "):
            title = line.strip()
        if open_paragraph and not heading and not item:
            blocks[-1] += " " + line
        else:
            blocks.append(line)
        open_paragraph = not heading
    return title, "\n".join(blocks).strip()


# ---------------------------------------------------------------- a fetched page (page_qa)


@dataclass(frozen=True)
class PageText:
    """The readable part of a page: its title ("" when unknown) and main text (never empty)."""

    title: str
    text: str


def extract_page(body: bytes, content_type: str) -> PageText:
    """Title and main text of a fetched body: HTML through trafilatura, PDF through pypdf (text layer only),
    Markdown without its marks (`markdown_text`: the same text as the page's HTML), other text/* as it is.

    Raises ToolFailure(unsupported_media) for other media types and for pages with no readable text.
    """
    media, charset = parse_content_type(content_type)
    looks_html = not media and body.lstrip()[:1] == b"<"  # servers that send no type: sniff the first byte
    if media in HTML_TYPES or looks_html:
        title, text = html_text(_decode(body, charset) if charset else body)
        page = PageText(title=title[:MAX_TITLE_CHARS], text=text)
    elif media == PDF_TYPE or (not media and body.startswith(b"%PDF-")):
        page = _extract_pdf(body)
    elif media in MARKDOWN_TYPES:
        page = PageText(*markdown_text(_decode(body, charset)))
    elif media.startswith("text/") or not media:
        page = PageText(title="", text=_decode(body, charset).strip())
    else:
        raise ToolFailure("unsupported_media", f"page_qa reads HTML, PDF and plain text pages, not {media}")
    if not page.text:
        raise ToolFailure(
            "unsupported_media", "no readable text on this page (empty, or it needs JavaScript to render)"
        )
    return page


def parse_content_type(content_type: str) -> tuple[str, str | None]:
    """`text/html; charset=UTF-8` -> ("text/html", "UTF-8")."""
    media, _, params = content_type.partition(";")
    match = re.search(r"charset\s*=\s*[\"']?([\w.:-]+)", params, re.IGNORECASE)
    return media.strip().lower(), match.group(1) if match else None


def _decode(body: bytes, charset: str | None) -> str:
    """`body` in `charset`, or in UTF-8 (the web's majority encoding) where that names no encoding a page is
    written in: an unknown name, a bytes-to-bytes codec (base64, zip, rot13) or one of NOT_CHARSETS."""
    try:
        return body.decode(_text_codec(charset), errors="replace")
    except UnicodeError:  # a codec some library registered that refuses "replace" too
        return body.decode("utf-8", errors="replace")


def _text_codec(charset: str | None) -> str:
    try:
        codec = codecs.lookup(charset or "utf-8")
    except LookupError:
        return "utf-8"
    return codec.name if codec._is_text_encoding and codec.name not in NOT_CHARSETS else "utf-8"


def _extract_pdf(body: bytes) -> PageText:
    try:
        title, text = pdf_text(body)
    except UnreadablePdf as exc:  # damaged, truncated or password-protected; what pypdf said goes to the log
        logger.info("page_qa: %s", exc)
        raise ToolFailure("unsupported_media", f"this page is a {exc.reason} that pypdf cannot read") from exc
    if not text:
        raise ToolFailure("unsupported_media", "this PDF has no text layer (a scan?); page_qa does no OCR")
    return PageText(title=title[:MAX_TITLE_CHARS], text=text)
