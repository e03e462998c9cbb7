"""image_ops' per-session image store: a bounded cache of pixels over a record of how each image was made.

An image's id is derived from how it was made (`derived_id`), and the store keeps, per session, each id's
**recipe**: the request that made it (a pixel op's parent id and arguments, or a load's source), a few hundred
bytes. Pixels are the expensive part and are bounded per session, in sessions and in total; past a bound the least
recently used go. A call that names an image whose pixels went is served by making it again from its recipe
(image_ops.stored), so the store's load never changes what an episode observes: with 64 audit episodes in flight,
each zoom ~9 MP, the total bound evicts images of episodes still running, and a refusal there would read as the
policy's own mistake (in a replay, as a divergence).

What a session knows (recipes, find_text's regions, which regions were looked at, which image a region's zoom was
made from) is kept while the session is one of the `max_known_sessions` most recently used and the id one of its
`max_recipes` most recently used; past those it is forgotten with the pixels, and the id is unknown (invalid_args,
naming the session's images). A session forgotten whole is remembered a while longer as gone (`_Gone`: its ids,
3 bytes each, and how long it had been idle), so that a call naming one of its images hears that the image was
evicted with its session, not that it was never given. Ids are private to their session: the same call in two
sessions gives the same id, each session holding its own entry.

One lock guards the maps; stored images are never modified, so callers may read them after it is released.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from PIL import Image

from subagents.common import ToolFailure
from subagents.handles import MAX_LISTED
from subagents.pixels import WORKING, check_pixels, scaled


def derived_id(derivation: str) -> str:
    """`img_` and the first 6 hex digits of the derivation's SHA-1: short, as the policy reads ids."""
    return "img_" + hashlib.sha1(derivation.encode()).hexdigest()[:6]


@dataclass
class _Known:
    """What one session knows of its images, by id; `ids` in use order, least recent first."""

    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    recipes: dict[str, str] = field(default_factory=dict)  # id -> the request that made it, as JSON
    regions: dict[str, list[list[int]]] = field(default_factory=dict)  # id -> find_text's boxes, r1 first
    looked: dict[str, list[str]] = field(default_factory=dict)  # id -> its regions looked at, in order
    made_from: dict[str, str] = field(default_factory=dict)  # a region's zoom or crop -> its source image
    used: float = field(default_factory=time.monotonic)  # when the session last used the store

    def forget(self, image_id: str) -> None:
        for table in (self.ids, self.recipes, self.regions, self.looked, self.made_from):
            table.pop(image_id, None)


@dataclass(frozen=True)
class _Gone:
    """A session forgotten whole: the ids it knew (3 bytes each: `img_` and 6 hex digits) and how long it had been
    idle when it was forgotten."""

    ids: bytes
    idle_s: float

    def knew(self, image_id: str) -> bool:
        try:
            key = bytes.fromhex(image_id.removeprefix("img_"))
        except ValueError:  # not an image id at all
            return False
        return len(key) == 3 and any(self.ids[i : i + 3] == key for i in range(0, len(self.ids), 3))


class ImageStore:
    """Images by (session, id). Putting an id the session already holds replaces that entry. Two derivations
    sharing 6 hex digits inside one session would make the later image replace the earlier: for a session of 32
    images the odds are 32*31/2 / 16**6, about 3e-5 (1 in 34,000); sessions never collide with each other."""

    def __init__(
        self,
        *,
        max_images_per_session: int,
        max_sessions: int,
        max_total_pixels: int,
        max_recipes: int,
        max_known_sessions: int,
        thumbnail_side: int,
    ) -> None:
        self.max_images_per_session, self.max_sessions = max_images_per_session, max_sessions
        self.max_total_pixels, self.thumbnail_side = max_total_pixels, thumbnail_side
        self.max_recipes, self.max_known_sessions = max_recipes, max_known_sessions
        self._lock = threading.Lock()
        # (session, id) -> pixels, least recently used first
        self._images: OrderedDict[tuple[str, str], Image.Image] = OrderedDict()
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> images held; least recent first
        self._known: OrderedDict[str, _Known] = OrderedDict()  # session -> what it knows; least recent first
        # Sessions forgotten whole, as many as are known (at most 256 x 512 ids x 3 bytes, ~400 KB, beside their
        # names): a policy names an image of its session some turns later, by then the session is back or gone.
        self._gone: OrderedDict[str, _Gone] = OrderedDict()
        self._pixels = 0
        self._freed = 0  # pixels evicted since `put` last told the working budget (subagents/pixels.py)

    @property
    def pixels_held(self) -> int:
        """Pixels the store holds now, over all sessions (at most `max_total_pixels`)."""
        with self._lock:
            return self._pixels

    def put(
        self,
        session: str,
        image: Image.Image,
        derivation: str,
        recipe: str | None = None,
        *,
        use: bool = True,
    ) -> str:
        """Store `image` for `session` under the id `derivation` gives (replacing the session's entry of that
        id, if any), made by `recipe` (None: it cannot be made again, only reloaded from where it came from), and
        return the id, evicting pixels as the bounds require. `use=False`: an image made again on the way to
        another (a re-make's chain) keeps its place in the session's use order, so what the session lists is
        what it would be had its pixels stayed, whatever other sessions evicted."""
        check_pixels(image.size, self.max_total_pixels, what="the image to store")
        image_id = derived_id(derivation)
        key = (session, image_id)
        with self._lock:
            self._drop_pixels(key)  # a refresh: re-added below as the most recently used
            if session not in self._sessions and len(self._sessions) >= self.max_sessions:
                oldest = next(iter(self._sessions))
                for stale in [k for k in self._images if k[0] == oldest]:
                    self._drop_pixels(stale)
            if self._sessions.get(session, 0) >= self.max_images_per_session:
                self._drop_pixels(next(k for k in self._images if k[0] == session))
            while self._pixels + image.width * image.height > self.max_total_pixels:
                self._drop_pixels(next(iter(self._images)))
            self._images[key] = image
            self._sessions[session] = self._sessions.get(session, 0) + 1
            self._sessions.move_to_end(session)
            self._pixels += image.width * image.height
            known = self._session(session)
            if use or image_id not in known.ids:
                known.ids[image_id] = None
                known.ids.move_to_end(image_id)
            if recipe is not None:
                known.recipes[image_id] = recipe
            while len(known.ids) > self.max_recipes:
                self._forget(session, next(iter(known.ids)))
            freed, self._freed = self._freed, 0
        if freed:  # evicted pixels go back to the system with image work's (a trim once none is in flight)
            WORKING.freed(freed)
        return image_id

    def pixels(self, session: str, image_id: str, *, use: bool = True) -> Image.Image | None:
        """The session's image if its pixels are held, else None; a use of it unless `use=False` (an image a
        re-make starts from)."""
        key = (session, image_id)
        with self._lock:
            image = self._images.get(key)
            if image is not None:
                self._images.move_to_end(key)
                self._sessions.move_to_end(session)
                if use:
                    self._session(session).ids.move_to_end(image_id)
            return image

    def get(self, session: str, image_id: str) -> Image.Image:
        """The session's image whose pixels are held; invalid_args naming the session's images otherwise."""
        image = self.pixels(session, image_id)
        if image is None:
            raise self.unknown(session, image_id)
        return image

    def recipe(self, session: str, image_id: str) -> str | None:
        """The request that made the session's image, as given to `put`; None if unknown or never given."""
        with self._lock:
            known = self._known.get(session)
            return known.recipes.get(image_id) if known is not None else None

    def held(self, session: str, *, reloadable: Collection[str] = ()) -> list[str]:
        """The ids the session can name: pixels held, a recipe to make them again, or `reloadable` (attached:
        loaded again from their source); most recently used first. An id keeps its place whether or not its
        pixels are held, so the order never depends on what other sessions evicted."""
        with self._lock:
            known = self._known.get(session) or _Known()
            usable = [
                i for i in known.ids if i in known.recipes or i in reloadable or (session, i) in self._images
            ]
            return usable[::-1]

    def unknown(self, session: str, image_id: str, *, also: list[str] | None = None) -> ToolFailure:
        """Why `image_id` is refused: not_found saying so if it was evicted with its session, else invalid_args
        naming the images the session can name (`unknown_message`)."""
        with self._lock:
            gone = self._gone.get(session)
        if gone is not None and gone.knew(image_id):
            idle = f"{gone.idle_s / 60:.0f} min" if gone.idle_s >= 90 else f"{gone.idle_s:.0f} s"
            return ToolFailure(
                "not_found",
                f"{image_id} was evicted with its session (idle for {idle}, past the {self.max_known_sessions} "
                "most recently used sessions the server keeps); load the image again",
            )
        return ToolFailure("invalid_args", self.unknown_message(session, image_id, also=also))

    def unknown_message(self, session: str, image_id: str, *, also: list[str] | None = None) -> str:
        """Why `image_id` is refused, naming the images the session can name: those it used, most recent
        first, then `also` (attached ones) it has not used."""
        also = also or []
        held = list(dict.fromkeys([*self.held(session, reloadable=set(also)), *also]))[:MAX_LISTED]
        shown = f"images here: {', '.join(held)}" if held else "use the image id the task gave"
        return f"no image {image_id[:40]!r} in this episode; {shown}"

    def set_regions(self, session: str, image_id: str, boxes: list[list[int]]) -> None:
        """What find_text found on the session's image, r1 first. New regions (find_text within a box) forget
        which regions were looked at."""
        with self._lock:
            known = self._known.get(session)
            if known is not None and image_id in known.ids:
                if known.regions.get(image_id) != boxes:
                    known.looked.pop(image_id, None)
                known.regions[image_id] = boxes

    def region(self, session: str, image_id: str, region: str) -> list[int]:
        """The box of `region` (r1, r2, ...) find_text found on the image; invalid_args naming the valid ones."""
        with self._lock:
            known = self._known.get(session)
            boxes = known.regions.get(image_id) if known is not None else None
        if not boxes:
            raise ToolFailure("invalid_args", f"{image_id} has no regions yet: call find_text on it first")
        index = int(region[1:]) - 1
        if index >= len(boxes):
            valid = f"r1 to r{len(boxes)}" if len(boxes) > 1 else "r1"
            raise ToolFailure("invalid_args", f"{image_id} has no region {region}: find_text gave {valid}")
        return boxes[index]

    def looked_at(self, session: str, image_id: str, region: str, made: str) -> None:
        """A zoom, crop or read looked at `region` of the session's image; `made` is the image it made (the
        image itself for a read)."""
        with self._lock:
            known = self._known.get(session)
            if known is None:
                return
            if image_id in known.regions:
                looked = known.looked.setdefault(image_id, [])
                looked.extend([region] if region not in looked else [])
            if made != image_id and made in known.ids:
                known.made_from[made] = image_id

    def unzoomed(self, session: str, image_id: str) -> list[str]:
        """The regions no zoom, crop or read has looked at yet, in find_text's order, of the image `image_id` was
        made from by a region's zoom or crop (else of `image_id` itself); [] where find_text never ran."""
        with self._lock:
            known = self._known.get(session) or _Known()
            source = known.made_from.get(image_id, image_id)
            count = len(known.regions.get(source, []))
            looked = known.looked.get(source, [])
        return [f"r{i}" for i in range(1, count + 1) if f"r{i}" not in looked]

    def thumbnail_png(self, image_id: str, *, session: str | None = None) -> bytes | None:
        """A PNG at most `thumbnail_side` px on its longest side; None unless its pixels are held. With
        `session`, only that session's image; without, any session's image of that id (the same derivation, so
        the same pixels)."""
        with self._lock:
            if session is not None:
                image = self._images.get((session, image_id))
            else:  # the most recently used holder
                image = next((img for (_, i), img in reversed(self._images.items()) if i == image_id), None)
        if image is None:
            return None
        side = self.thumbnail_side
        image = scaled(image, side, Image.Resampling.BILINEAR) if max(image.size) > side else image
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    def _session(self, session: str) -> _Known:
        """The session's record, made the most recently used; the least recently used one past
        `max_known_sessions` is forgotten with its pixels. Under the lock."""
        known = self._known.get(session)
        if known is None:
            known = self._known[session] = _Known()
            while len(self._known) > self.max_known_sessions:
                self._forget_session(*self._known.popitem(last=False))
        self._known.move_to_end(session)
        known.used = time.monotonic()
        return known

    def _forget_session(self, session: str, known: _Known) -> None:
        """Drop a session's pixels and record, remembering it as gone. Under the lock."""
        for stale in [k for k in self._images if k[0] == session]:
            self._drop_pixels(stale)
        ids = b"".join(bytes.fromhex(i.removeprefix("img_")) for i in known.ids)
        self._gone[session] = _Gone(ids=ids, idle_s=time.monotonic() - known.used)
        self._gone.move_to_end(session)
        while len(self._gone) > self.max_known_sessions:
            self._gone.popitem(last=False)

    def _forget(self, session: str, image_id: str) -> None:
        """Drop everything the session knows of `image_id`, pixels included. Under the lock."""
        self._drop_pixels((session, image_id))
        self._known[session].forget(image_id)

    def _drop_pixels(self, key: tuple[str, str]) -> None:
        """Evict the pixels only: the id and its recipe stay. Under the lock."""
        image = self._images.pop(key, None)
        if image is None:
            return
        self._pixels -= image.width * image.height
        self._freed += image.width * image.height
        session = key[0]
        self._sessions[session] -= 1
        if self._sessions[session] == 0:
            del self._sessions[session]
