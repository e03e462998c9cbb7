"""PDFs written by hand for the tests that read one (pypdf reads text; it cannot typeset)."""

from __future__ import annotations


def minimal_pdf(lines: list[str], *, title: str | None = None) -> bytes:
    """A valid one-page PDF showing `lines` in Helvetica (written by hand: pypdf reads text, it cannot typeset),
    with an /Info /Title when `title` is given; the xref table has exact byte offsets."""
    return pages_pdf([lines], title=title)


def pages_pdf(pages: list[list[str]], *, title: str | None = None) -> bytes:
    """A valid PDF of one page per entry of `pages`, each showing its lines in Helvetica; objects: the
    catalog, the page tree, a page and its content stream per page, the font, the /Info dictionary."""
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(len(pages)))
    font = 3 + 2 * len(pages)
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode(),
    ]
    for number, lines in enumerate(pages):
        shown = " 0 -16 Td ".join(f"({line}) Tj" for line in lines)
        stream = f"BT /F1 12 Tf 72 720 Td {shown} ET".encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * number} 0 R"
            f" /Resources << /Font << /F1 {font} 0 R >> >> >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    objects.append(f"<< /Title ({title}) >>".encode() if title else b"<< >>")
    return _written(objects)


def form_pdf(lines: list[str]) -> bytes:
    """A one-page PDF whose page draws one form XObject (`/X1 Do`) that shows `lines`."""
    text = " 0 -16 Td ".join(f"({line}) Tj" for line in lines)
    form = f"BT /F1 12 Tf 72 720 Td {text} ET".encode()
    fonts = b"/Font << /F1 5 0 R >>"
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << %s /XObject << /X1 6 0 R >> >> >>" % fonts,
        b"<< /Length 6 >>\nstream\n/X1 Do\nendstream",  # nothing after the form: it ends the page
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << %s >> /Length %d >>\n"
        b"stream\n%s\nendstream" % (fonts, len(form), form),
        b"<< >>",
    ]
    return _written(objects)


def _written(objects: list[bytes]) -> bytes:
    """`objects` numbered from 1 in a PDF file whose xref table has exact byte offsets; the last is /Info."""
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    trailer = b"trailer\n<< /Size %d /Root 1 0 R /Info %d 0 R >>\nstartxref\n%d\n%%%%EOF\n"
    out += trailer % (len(objects) + 1, len(objects), xref)
    return bytes(out)


def damaged_pdf() -> bytes:
    """`minimal_pdf` with 4 bytes of its trailer changed (the newline after `trailer`, a space, an `o` of
    /Root and the `I` of /Info): pypdf 7 raises AttributeError on it, not its own PyPdfError."""
    whole = minimal_pdf(["Basalt columns form when thick lava cools slowly."])
    trailer = b"trailer\n<< /Size 7 /Root 1 0 R /Info 6 0 R"
    assert whole.count(trailer) == 1, whole[-120:]
    return whole.replace(trailer, b"trailer2<<[/Size 7 /R9ot 1 0 R /%nfo 6 0 R")
