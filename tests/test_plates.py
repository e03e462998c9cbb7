"""The plate expert on hand-built turns: the plate-shaped answer, the retry, and recovery from refused calls."""

from __future__ import annotations

import json

import pytest

from conductor.plates import plate_shaped
from main_agent.parse import ANSWER_OPEN, CALL_OPEN
from main_agent.types import Record, ToolCall, ToolResult, Turn
from subagents.handles import Attachment
from training.tasks import batch, plate_audit, plates
from training.tasks.plates import GAVE_UP
from training.tasks.task import Task, TaskMeta

PHOTO = Attachment("image", "/data/car.jpg", "sha256:car")
# The gold box is [400, 300, 470, 330]: r2 overlaps it, r4 boxes it loosely, r1 and r3 lie elsewhere.
BOXES = [
    {"id": "r1", "box": [100, 50, 300, 90]},
    {"id": "r2", "box": [405, 302, 468, 328]},
    {"id": "r3", "box": [600, 400, 660, 420]},
    {"id": "r4", "box": [380, 280, 520, 360]},
]


def car(task_id: str = "plate-us-car", reference: str = "7ABC123") -> Task:
    meta = TaskMeta(image_path="/data/car.jpg", plate_box=(400, 300, 70, 30), split="train")
    return Task(task_id, "plate_reading", plates.QUESTION, ("image_ops",), reference, PHOTO.line, meta,
                attachments=(PHOTO,))  # fmt: skip


def turn(arguments: dict[str, object], payload: dict[str, object] | None, *, error: str = "") -> Turn:
    """One turn of one image_ops call: served with `payload`, or refused with `error` as its observation."""
    call = ToolCall("image_ops", arguments, "")
    ok = payload is not None
    result = ToolResult(
        "image_ops", ok, error or "ok", None if ok else "invalid_args", 1.0, 0, 0, False, payload
    )
    return Turn([], [], [], "", "", [call], [result], [], 0, 0.0, 0.0)


def found(*ids: str) -> Turn:
    boxes = [b for b in BOXES if b["id"] in ids]
    return turn(
        {"op": "find_text", "image": PHOTO.handle},
        {"op": "find_text", "image_id": PHOTO.handle, "boxes": boxes},
    )


def zoomed(region: str) -> Turn:
    image = f"img_z{region}"
    return turn({"op": "zoom", "image": PHOTO.handle, "region": region}, {"op": "zoom", "image_id": image})


def read(image: str, text: str) -> Turn:
    return turn({"op": "read", "image": image}, {"op": "read", "image_id": image, "text": text})


def refused(arguments: dict[str, object]) -> Turn:
    return turn(
        arguments, None, error=f"no image {arguments['image']!r} in this episode; images here: img_zr2"
    )


def step(task: Task, turns: list[Turn]) -> tuple[str, dict[str, object]] | str:
    """The expert's next reply: ("call", arguments) or the answer's text."""
    reply = plates.oracle_reply(task, turns, trust_reference=False)
    if reply.startswith(CALL_OPEN):
        return "call", json.loads(reply[len(CALL_OPEN) :].split("</tool_call>")[0])["arguments"]
    assert reply.startswith(ANSWER_OPEN), reply
    return reply[len(ANSWER_OPEN) :].split("</answer>")[0]


@pytest.mark.parametrize(
    ("read_text", "plate"),
    [
        ("YG9-X2G\nSUNTRUP", "YG9X2G"),  # a dealer's line under the plate
        ("PRCURITIBAAZJ6991", "AZJ6991"),  # state and city run into the plate
        ("TEXAS CRK-4732", "CRK4732"),  # the state beside it on one line
        ("Cal 1-800 2ADVISE\n7FR-971", "7FR971"),  # a whole plate-shaped line beats a run of words
        ("CA EXEMPT\n1366026", "1366026"),  # digits alone are a plate when nothing better is
        ("EXP 12/05/2019\n1366026", "1366026"),  # a date is not
        ("2014-05-13 07:25:13", None),  # a camera's time stamp, not a plate
        ("2014-04-2806:40:28\n1T4:3213", "1T43213"),  # a time stamp run together; a plate's one colon
        ("FORDBASIMESFILHO", None),  # a dealer's frame: words only
        ("WASHINGTON 9\n281-447-8600", None),  # a state, a phone number
        ("", None),
    ],
)
def test_plate_shaped_picks_the_plate_of_a_read_by_a_visible_rule(read_text: str, plate: str | None) -> None:
    """The plate-shaped part of a read: a city, state, date, phone or dealer line is never the answer."""
    assert plate_shaped(read_text) == plate


def test_the_expert_answers_the_plate_shaped_text_never_the_label() -> None:
    """The answer is what the read shows in a plate's shape, even where the hidden label is a part of it."""
    task = car(reference="ANW2529")
    turns = [found("r2"), zoomed("r2"), read("img_zr2", "4ANW2529\nARIZONA")]
    assert step(task, turns) == "4ANW2529"


def test_a_read_without_a_plate_tries_the_next_region_then_an_autocontrast() -> None:
    """No plate-shaped text: zoom on the next region in find_text's order; regions spent: autocontrast the
    first zoom; MAX_ATTEMPTS spent: answer GAVE_UP, not the words it read."""
    task = car()
    turns = [found("r1", "r2")]
    assert step(task, turns) == ("call", {"op": "zoom", "image": PHOTO.handle, "region": "r1"})
    turns += [zoomed("r1"), read("img_zr1", "CALIFORNIA")]
    assert step(task, turns) == ("call", {"op": "zoom", "image": PHOTO.handle, "region": "r2"})
    turns += [zoomed("r2"), read("img_zr2", "DEALER")]
    assert step(task, turns) == ("call", {"op": "autocontrast", "image": "img_zr1"})
    contrast = {"op": "autocontrast", "image_id": "img_zr1a"}
    turns += [turn({"op": "autocontrast", "image": "img_zr1"}, contrast)]
    assert step(task, turns) == ("call", {"op": "read", "image": "img_zr1a"})
    assert step(task, [*turns, read("img_zr1a", "CALIFORNIA")]) == GAVE_UP
    assert step(task, [*turns, read("img_zr1a", "7ABC 123")]) == "7ABC123"


def test_regions_are_tried_in_find_texts_order_whatever_the_gold_box() -> None:
    """r1 first, then r2, ...: the order the policy sees; the plate's box (under r2 and r4 here) orders
    nothing, and at most MAX_ATTEMPTS zoomed reads are made."""
    task = car()
    turns = [found("r1", "r2", "r3", "r4")]
    for region in ("r1", "r2", "r3"):
        assert step(task, turns) == ("call", {"op": "zoom", "image": PHOTO.handle, "region": region})
        turns += [zoomed(region), read(f"img_z{region}", "TEXAS")]
    assert step(task, turns) == GAVE_UP


def test_a_refused_read_is_recovered_with_a_valid_handle() -> None:
    """A read refused (its zoom evicted or mistyped) is followed by a zoom on the photo, whose handle is always
    valid, and the read of what that zoom returns."""
    task = car()
    turns = [found("r2"), zoomed("r2"), refused({"op": "read", "image": "img_zr2"})]
    assert step(task, turns) == ("call", {"op": "zoom", "image": PHOTO.handle, "region": "r2"})
    turns += [zoomed("r2")]
    assert step(task, turns) == ("call", {"op": "read", "image": "img_zr2"})
    assert step(task, [*turns, read("img_zr2", "7ABC 123")]) == "7ABC123"


def test_repeated_refusals_end_the_photo_with_what_the_expert_has() -> None:
    """After MAX_REFUSALS refused calls on one photo the expert answers what it has."""
    task = car()
    turns = [found("r2"), zoomed("r2")]
    turns += [refused({"op": "read", "image": "img_zr2"})] * plates.MAX_REFUSALS
    assert step(task, turns) == GAVE_UP


def test_an_audit_moves_on_after_repeated_refusals_on_one_photo() -> None:
    """plate_audit's expert records the photo it could not read and opens the next one."""
    first, second = car("plate-us-a"), car("plate-us-b", reference="8XYZ999")
    audit = batch.bundle(
        plate_audit.NAME, [first, second], 2, question=plate_audit.QUESTION, item_lines=plate_audit.item_lines
    )[0]
    turns = [found("r2"), zoomed("r2"), *[refused({"op": "read", "image": "img_zr2"})] * plates.MAX_REFUSALS]
    reply = plate_audit.oracle_reply(audit, turns, trust_reference=False)
    assert reply == f'<record item="1">{GAVE_UP}</record>'
    recorded = Turn([], [], [], reply, "", [], [], [], 0, 0.0, 0.0, records=[Record(1, GAVE_UP, reply)])
    after = plate_audit.oracle_reply(audit, [*turns, recorded], trust_reference=False)
    assert after.startswith(CALL_OPEN) and '"find_text"' in after


def test_the_first_mistake_offered_is_a_zoom_before_find_text_at_each_photos_first_turn() -> None:
    """plates offer a zoom on r1 of the photo before find_text at the photo's first turn; an audit offers it
    again at the first turn of every photo, naming that photo."""
    first, second = car("plate-us-a"), car("plate-us-b", reference="8XYZ999")
    zoom = '"op": "zoom", "image": "%s", "region": "r1"'
    assert zoom % PHOTO.handle in str(plates.mistake_reply(first, []))
    assert plates.mistake_reply(first, [found("r2")]) is None
    audit = batch.bundle(
        plate_audit.NAME, [first, second], 2, question=plate_audit.QUESTION, item_lines=plate_audit.item_lines
    )[0]
    assert zoom % PHOTO.handle in str(plate_audit.mistake_reply(audit, []))
    reply = f'<record item="1">{GAVE_UP}</record>'
    recorded = Turn([], [], [], reply, "", [], [], [], 0, 0.0, 0.0, records=[Record(1, GAVE_UP, reply)])
    assert plate_audit.mistake_reply(audit, [found("r2"), recorded]) is not None
    assert plate_audit.mistake_reply(audit, [found("r2")]) is None
    done = Turn([], [], [], "", "", [], [], [], 0, 0.0, 0.0, records=[Record(2, GAVE_UP, reply)])
    assert plate_audit.mistake_reply(audit, [recorded, done]) is None


def test_the_second_mistake_offered_is_a_zoom_on_r2_right_after_find_text() -> None:
    """Right after find_text named two regions or more, the mistake offered is a zoom on r2 (not the first
    region); with one region, or once a zoom was made, none is offered."""
    task = car()
    assert '"region": "r2"' in str(plates.mistake_reply(task, [found("r1", "r2", "r3")]))
    assert plates.mistake_reply(task, [found("r1")]) is None
    assert plates.mistake_reply(task, [found("r1", "r2"), zoomed("r1")]) is None
    assert plates.mistake_reply(task, [found("r1", "r2"), zoomed("r1"), read("img_zr1", "TEXAS")]) is None


def test_after_a_zoom_on_r2_first_the_retry_takes_the_first_region_not_zoomed_yet() -> None:
    """A read without a plate is followed by the first region not zoomed yet, the first the read names
    ("not zoomed yet: r1, r3"): after r2 (the deliberate mistake) r1, then r3."""
    task = car()
    turns = [found("r1", "r2", "r3"), zoomed("r2"), read("img_zr2", "TEXAS")]
    assert step(task, turns) == ("call", {"op": "zoom", "image": PHOTO.handle, "region": "r1"})
    turns += [zoomed("r1"), read("img_zr1", "DEALER")]
    assert step(task, turns) == ("call", {"op": "zoom", "image": PHOTO.handle, "region": "r3"})
    turns += [zoomed("r3"), read("img_zr3", "7ABC 123")]
    assert step(task, turns) == "7ABC123"
    assert plates.next_region(["r1", "r2"], ["r2"]) == "r1"
    assert plates.next_region(["r1", "r2"], ["r1", "r2"]) is None
