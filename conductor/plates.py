"""Plate-shaped text: the part of a read that looks like a licence plate, by a rule anyone can apply to what it saw.

One definition for everyone who needs it: image_ops' read names it in its observation (so the policy answers
what it saw, and sees when a read holds no plate and another region is worth a try), the plate expert answers
it, the rewards compare plates after `normalize_plate`, and the plates benchmark scores the rule.
"""

from __future__ import annotations

import re

_NOT_PLATE = re.compile(r"[^A-Z0-9]")

# Plate-shaped text, the rule the expert answers by (`plate_shaped`): 5-8 letters and digits with at least one digit.
# Chosen on the US train photos' reads, reported on the EU photos' (docs/plates.md): every US and EU plate in the
# shared data is 5-8 characters long; a read line of letters alone is a state, a city or a dealer (the few vanity
# plates without a digit are given up), one of 9+ characters a phone number, a web address or a frame run together.
PLATE_LENGTH = (5, 8)
# Letters a plate opens with before its first digit, at most: where a line runs a city into the plate
# ("PRCURITIBAAZJ6991"), the plate is the digit's run with at most this many letters before it.
PLATE_LEAD = 3


def normalize_plate(s: str) -> str:
    """Uppercase and keep only A-Z and 0-9. No look-alike mapping (O/0, I/1): the reader must get them right."""
    return _NOT_PLATE.sub("", s.upper())


def plate_shaped(text: str) -> str | None:
    """The plate-shaped part of a read, normalised (A-Z, 0-9), or None when it holds none: what a read names
    as plate-shaped, and the expert's answer.

    In order of trust: a whole line that is plate-shaped (`is_plate_shaped`: "YG9-X2G", "K17 9658"); else the
    longest run of a line's words that is ("TEXAS CRK-4732" -> CRK4732); else, inside a word run together past
    the plate's length ("PRCURITIBAAZJ6991"), its first digit with at most PLATE_LEAD letters before it and what
    follows, up to the longest plate (AZJ6991). Within a tier, letters and digits beat digits alone (a sticker's
    number, a year), then the read's order."""
    lines = text.splitlines()
    for tier in (_whole_line, _word_run, _run_together):
        found = [plate for line in lines if (plate := tier(line))]
        if found:
            return min(found, key=str.isdigit)  # the first with a letter, else the first
    return None


def is_plate_shaped(text: str) -> bool:
    """PLATE_LENGTH letters and digits with at least one digit (after `normalize_plate`), and not a date."""
    plate = normalize_plate(text)
    fits = PLATE_LENGTH[0] <= len(plate) <= PLATE_LENGTH[1] and any(c.isdigit() for c in plate)
    return fits and not _DATE.search(text)


# A date or a time of day: a sticker's date (12/05/2019, 5.12.19), a camera's time stamp (2014-05-13, 07:25:13).
# A plate's one separator never makes these: "1T4:3213" has one colon, a time two; "RK-755AJ" no 4-digit year.
_DATE = re.compile(r"\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b|\b\d{4}-\d{1,2}-\d{1,2}|\d{1,2}:\d{2}:\d{2}\b")


def _whole_line(line: str) -> str | None:
    return normalize_plate(line) if is_plate_shaped(line) else None


def _word_run(line: str) -> str | None:
    words = line.split()
    runs = [" ".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)]
    best = max(filter(is_plate_shaped, runs), key=lambda run: len(normalize_plate(run)), default=None)
    return normalize_plate(best) if best else None


_RUN_TOGETHER = re.compile(rf"[A-Z]{{0,{PLATE_LEAD}}}\d[A-Z\d]*")


def _run_together(line: str) -> str | None:
    for word in line.split():
        run = normalize_plate(word)
        found = _RUN_TOGETHER.search(run) if len(run) > PLATE_LENGTH[1] and not _DATE.search(word) else None
        plate = found.group()[: PLATE_LENGTH[1]] if found else ""
        if is_plate_shaped(plate) and not plate.isdigit():  # digits alone run past a plate: a phone number
            return plate
    return None
