"""Handles: the policy names what it saw by short handles (subagents/handles.py), and nothing it reads holds a
path. Unit tests of the table and of regions, then the real tool server (real search, page_qa, image_ops and
video_summary) over its ASGI app, then every task family's prompt and observations through the real tools."""

from __future__ import annotations

import io
import itertools
import re
import tracemalloc
from collections import Counter
from pathlib import Path

import httpx
import pytest
from PIL import Image

from main_agent.rollout import RolloutConfig, RolloutTask, rollout
from subagents import image_ops
from subagents.common import Runtime, ToolFailure
from subagents.handles import Attachment, Handles, Ref, content_key, file_key, handle_for
from subagents.image_ops import Config, ImageStore, Request, image_store
from tests.fakes import TOOLS, ByteChatTokenizer, ScriptedPolicy, call_text, echo_tool, fake_tool_server
from tests.tool_server_fakes import FakeFactory, make_config
from tool_server.app import create_app
from tool_server.client import ToolClient, ToolServerError
from tool_server.embedded import embedded_config

# What a prompt or observation must never hold: an absolute path, or a file:// URL naming a folder.
MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:home|root|work|tmp|usr|var|Users|mnt|opt|srv)/|file://")


# ---------------------------------------------------------------- the names


def test_handles_are_short_and_derive_from_content_or_url_never_the_path(tmp_path: Path) -> None:
    """A file's handle comes from its bytes: the same photo at a short and at a 100+ character path has the
    same handle; a page's from its key; each kind has its own prefix and 6 hex digits."""
    short = tmp_path / "a.jpg"
    deep = tmp_path / ("x" * 60) / ("y" * 60) / "car.jpg"
    deep.parent.mkdir(parents=True)
    for path in (short, deep):
        path.write_bytes(b"the same bytes")
    assert file_key(short) == file_key(deep) == content_key(b"the same bytes")
    photo, far = (
        Attachment("image", str(short), file_key(short)),
        Attachment("image", str(deep), file_key(deep)),
    )
    assert photo.handle == far.handle and re.fullmatch(r"img_[0-9a-f]{6}", photo.handle)
    assert re.fullmatch(r"d_[0-9a-f]{6}", handle_for("page", "corpus/smollm2.html"))
    assert re.fullmatch(r"v_[0-9a-f]{6}", handle_for("video", "sha256:00"))
    page = Attachment("page", "http://127.0.0.1:5000/t/0.html", "pages/t/0.html", "Paris")
    assert page.line == f"Page: {handle_for('page', 'pages/t/0.html')} Paris" and "127.0.0.1" not in page.line


def test_a_handle_resolves_only_in_its_session_and_for_its_kind() -> None:
    """Another session's handle, an unknown one and one of another kind are invalid_args; the message lists
    the session's handles of the kind asked for (or says how to get one), never a source."""
    table = Handles()
    table.add("a", "d_111111", Ref("page", "file:///srv/corpus/x.html", "X"))
    table.add("a", "v_222222", Ref("video", "/srv/clips/c.mp4"))
    assert table.resolve("a", "d_111111", "page").source == "file:///srv/corpus/x.html"
    for session, handle, kind in [
        ("b", "d_111111", "page"),
        ("a", "d_999999", "page"),
        ("a", "v_222222", "page"),
    ]:
        with pytest.raises(ToolFailure) as refused:
            table.resolve(session, handle, kind)
        assert refused.value.error.kind == "invalid_args" and "/srv" not in refused.value.error.message
    with pytest.raises(ToolFailure, match="pages shown: d_111111"):
        table.resolve("a", "d_999999", "page")
    with pytest.raises(ToolFailure, match="search first"):
        table.resolve("b", "d_111111", "page")


def test_the_table_is_bounded_per_session_and_in_sessions() -> None:
    """Past max_per_session the least recently used handle goes; past max_sessions the oldest session."""
    table = Handles(max_per_session=2, max_sessions=2)
    for n in range(3):
        table.add("a", f"d_00000{n}", Ref("page", f"http://x/{n}"))
    assert table.get("a", "d_000000") is None and table.get("a", "d_000002") is not None
    table.add("b", "d_000009", Ref("page", "http://y"))
    table.add("c", "d_000009", Ref("page", "http://z"))
    assert table.get("a", "d_000002") is None and table.get("c", "d_000009") == Ref("page", "http://z")


def test_a_session_that_uses_its_handles_is_not_the_one_evicted() -> None:
    """Resolving or getting a handle counts as use of its session: a session that reads its page after each of 256
    new sessions still has it, and the session evicted is the least recently used one (before: eviction followed
    registration only, so the page was gone at the 256th)."""
    table = Handles()
    table.add("mine", "d_111111", Ref("page", "http://x/mine"))
    for n in range(table.max_sessions):
        table.add(f"other{n}", "d_222222", Ref("page", f"http://y/{n}"))
        found = table.resolve("mine", "d_111111", "page") if n % 2 else table.get("mine", "d_111111")
        assert found == Ref("page", "http://x/mine"), n
    assert table.get("other0", "d_222222") is None and table.get("other1", "d_222222") is not None


def test_the_table_is_bounded_in_bytes() -> None:
    """256 sessions of 256 handles, each standing for a 2,048-character source (the longest /v1/attach takes), keep
    the table at most `max_bytes` by its own count and grow Python's memory by less than twice that; the newest
    session is whole (before: only counts were bounded, and these 65,536 sources took ~150 MB)."""
    tracemalloc.start()
    table = Handles()
    for s in range(256):
        for h in range(256):
            source = f"https://example.org/{s:03d}/{h:03d}/" + "x" * 2020  # 2,048 characters
            table.add(f"s{s}", f"d_{h:06x}", Ref("page", source))
    grown = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert table.bytes <= table.max_bytes and grown < 2 * table.max_bytes, (table.bytes, grown)
    assert all(table.get("s255", f"d_{h:06x}") is not None for h in range(256))


# ---------------------------------------------------------------- regions


def store_runtime(store: ImageStore, handles: Handles | None = None, **kw: object) -> Runtime[ImageStore]:
    return Runtime(llm=None, fetcher=None, state=store, session="s", handles=handles or Handles(), **kw)  # type: ignore[arg-type]


async def run(rt: Runtime[ImageStore], **args: object) -> image_ops.Response:
    return await image_ops.run(Request(**args), Config(), rt)  # type: ignore[arg-type]


async def test_a_region_is_zoomed_with_the_margin_clamped_to_the_image() -> None:
    """zoom/crop/read by region use find_text's box grown by its height on every side, inside the image: the
    same image (id and pixels) as zooming on that box by hand."""
    store = image_store(Config())
    photo = store.put("s", Image.new("RGB", (1000, 600), "white"), "load\nphoto")
    store.set_regions("s", photo, [[405, 302, 468, 328], [990, 590, 1000, 600]])
    rt = store_runtime(store)
    by_region = await run(rt, op="zoom", image=photo, region="r1")
    by_box = await run(rt, op="zoom", image=photo, box=[379, 276, 494, 354])
    assert by_region.ok and (by_region.image_id, by_region.width) == (by_box.image_id, by_box.width)
    assert image_ops.region_box([990, 590, 1000, 600], (1000, 600)) == [980, 580, 1000, 600]
    assert image_ops.region_box([10, 5, 80, 35], (100, 50)) == [0, 0, 100, 50]
    crop = await run(rt, op="crop", image=photo, region="r2")
    assert (crop.width, crop.height) == (20, 20)


async def test_a_wrong_region_is_an_observation_naming_the_valid_ones() -> None:
    """A region before find_text, past the last one, with an op that takes none, or with a box too: a clear
    refusal the policy can act on (invalid_args), never a crash."""
    store = image_store(Config())
    photo = store.put("s", Image.new("RGB", (100, 100)), "load\nphoto")
    rt = store_runtime(store)
    before = await run(rt, op="zoom", image=photo, region="r1")
    assert before.error is not None and "call find_text on it first" in before.error.message
    store.set_regions("s", photo, [[10, 10, 40, 20], [50, 50, 90, 60]])
    past = await run(rt, op="read", image=photo, region="r9")
    assert past.error is not None and past.error.kind == "invalid_args" and "r1 to r2" in past.error.message
    for bad in ({"op": "rotate", "region": "r1"}, {"op": "zoom", "region": "r1", "box": [0, 0, 5, 5]}):
        with pytest.raises(ValueError):
            Request(image=photo, **bad)
    with pytest.raises(ValueError):
        Request(op="zoom", image=photo, region="1")


async def test_an_attached_image_is_loaded_on_first_use_under_its_handle(tmp_path: Path) -> None:
    """An image attached by path has its handle before any call; the first op on the handle loads it from the
    files roots; a file changed since it was attached is refused, not silently swapped."""
    png = io.BytesIO()
    Image.new("RGB", (64, 32), "white").save(png, format="PNG")
    (tmp_path / "p.png").write_bytes(png.getvalue())
    attached = Attachment("image", str(tmp_path / "p.png"), file_key(tmp_path / "p.png"))
    handles = Handles()
    handles.add("s", attached.handle, Ref("image", attached.source))
    rt = store_runtime(image_store(Config()), handles, roots=(str(tmp_path),))
    flipped = await run(rt, op="flip", image=attached.handle)
    assert flipped.ok and (flipped.width, flipped.height) == (64, 32)
    assert rt.state.pixels("s", attached.handle) is not None
    (tmp_path / "p.png").write_bytes(png.getvalue() + b"\0")
    fresh = store_runtime(image_store(Config()), handles, roots=(str(tmp_path),))
    changed = await run(fresh, op="read", image=attached.handle)
    assert changed.error is not None and "changed since it was attached" in changed.error.message


async def test_a_wrong_image_id_lists_the_attached_images_and_load_takes_a_handle(tmp_path: Path) -> None:
    """Two images attached, none used yet: an unknown id is refused naming both attached handles (before: "use
    the image id the task gave", as if none were); `load` given an attached image's handle loads that image under
    its handle, and given an unknown one is refused with the same list (before: read as a file path, not_found)."""
    handles, attached = Handles(), []
    for name, size in (("a.png", (64, 32)), ("b.png", (32, 32))):
        png = io.BytesIO()
        Image.new("RGB", size, "white").save(png, format="PNG")
        (tmp_path / name).write_bytes(png.getvalue())
        attached.append(Attachment("image", str(tmp_path / name), file_key(tmp_path / name)))
        handles.add("s", attached[-1].handle, Ref("image", attached[-1].source))
    rt = store_runtime(image_store(Config()), handles, roots=(str(tmp_path),))
    forged = await run(rt, op="read", image="img_000000")
    loaded = await run(rt, op="load", image=attached[1].handle)
    unknown = await run(rt, op="load", image="img_000000")
    for refused in (forged, unknown):
        assert refused.error is not None and refused.error.kind == "invalid_args", refused.observation()
        assert all(a.handle in refused.error.message for a in attached), refused.error.message
    assert loaded.ok and loaded.image_id == attached[1].handle and (loaded.width, loaded.height) == (32, 32)


# ---------------------------------------------------------------- the real server


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "paris.html").write_text(
        "<html><head><title>Paris</title></head><body><p>Paris is the capital of France. "
        "The Eiffel Tower is 330 metres tall.</p></body></html>"
    )
    (folder / "berlin.html").write_text(
        "<html><head><title>Berlin</title></head><body><p>Berlin is the capital of Germany.</p></body></html>"
    )
    return folder


def real_app(corpus: Path, roots: tuple[str, ...] = ()):
    """The real app and sub-agents (search over `corpus`, page_qa reading it) on a fake text model."""
    cfg = embedded_config(make_config(), roots=roots, corpus=corpus)
    return create_app(cfg, llm_factory=FakeFactory(answer="330 metres"))


async def client_of(app) -> ToolClient:
    return ToolClient("http://127.0.0.1:8700", transport=httpx.ASGITransport(app=app), deadline_s=30.0)


async def test_search_hits_are_read_by_handle_and_never_show_a_path(corpus: Path) -> None:
    """search shows hits as `d_... title — snippet`; page_qa takes a hit's handle in the session that saw it
    and answers with the page's title as source; neither observation holds the file:// URL."""
    app = real_app(corpus)
    async with app.router.lifespan_context(app), await client_of(app) as tools:
        found = await tools.call("search", {"query": "Eiffel Tower"}, session="e1")
        hit = found.payload["hits"][0]
        assert hit["id"] == handle_for("page", "corpus/paris.html") and hit["url"].startswith("file://")
        assert found.observation.startswith(f"{hit['id']} Paris — ")
        read = await tools.call("page_qa", {"url": hit["id"], "question": "How tall?"}, session="e1")
        assert read.ok and read.observation.endswith("source: Paris"), read.observation
        assert read.payload["url"] == hit["url"]
        for text in (found.observation, read.observation):
            assert not MACHINE_PATH.search(text), text


async def test_a_wrong_handle_is_invalid_args_listing_the_valid_ones(corpus: Path) -> None:
    """An unknown handle, another session's and one of another kind are observations (invalid_args) naming the
    pages this episode was shown, never a 500 or an infrastructure error; the server stays healthy."""
    app = real_app(corpus)
    async with app.router.lifespan_context(app), await client_of(app) as tools:
        found = await tools.call("search", {"query": "capital"}, session="e1")
        shown = [h["id"] for h in found.payload["hits"]]
        unknown = await tools.call("page_qa", {"url": "d_000000", "question": "What?"}, session="e1")
        assert unknown.error is not None and unknown.error.kind == "invalid_args"
        assert all(h in unknown.observation for h in shown)
        miscopied = await tools.call("page_qa", {"url": shown[0][:-1], "question": "What?"}, session="e1")
        assert miscopied.error is not None and all(h in miscopied.observation for h in shown)
        foreign = await tools.call("page_qa", {"url": shown[0], "question": "What?"}, session="e2")
        assert foreign.error is not None and "search first" in foreign.error.message
        kind = await tools.call("video_summary", {"video": shown[0]}, session="e1")
        assert kind.error is not None and kind.error.kind == "invalid_args"
        image = await tools.call("image_ops", {"op": "read", "image": "img_000000"}, session="e1")
        assert image.error is not None and image.error.kind == "invalid_args"
        assert (await tools.health())["status"] == "ok"


async def test_an_error_about_a_handle_names_it_and_no_machine_path(corpus: Path) -> None:
    """A search hit whose file has gone since: page_qa on its handle is `not_found` naming the handle and the
    path relative to its files root, as errors about a path the caller gave do (before: the server's absolute
    path, which the policy was never shown)."""
    app = real_app(corpus)
    async with app.router.lifespan_context(app), await client_of(app) as tools:
        found = await tools.call("search", {"query": "Eiffel Tower"}, session="e1")
        hit = found.payload["hits"][0]
        (corpus / "paris.html").unlink()
        gone = await tools.call("page_qa", {"url": hit["id"], "question": "How tall?"}, session="e1")
    assert gone.error is not None and gone.error.kind == "not_found", gone.observation
    assert f"page {hit['id']}: " in gone.observation and "'paris.html'" in gone.observation, gone.observation
    assert not MACHINE_PATH.search(gone.observation), gone.observation


async def test_the_cache_is_keyed_by_what_a_handle_stands_for(corpus: Path) -> None:
    """The same question on the same page asked by handle in two sessions, and by URL, is one computation:
    the cache sees the page, not the handle (handles are per session; pages are not)."""
    app = real_app(corpus)
    async with app.router.lifespan_context(app), await client_of(app) as tools:
        answers = []
        for session in ("e1", "e2"):
            found = await tools.call("search", {"query": "Eiffel"}, session=session)
            page = found.payload["hits"][0]
            answers.append(
                await tools.call("page_qa", {"url": page["id"], "question": "How tall?"}, session=session)
            )
        by_url = await tools.call("page_qa", {"url": page["url"], "question": "How tall?"}, session="e3")
        assert [a.cached for a in answers] + [by_url.cached] == [False, True, True]


async def test_attachments_are_registered_before_the_first_turn(corpus: Path, tmp_path: Path) -> None:
    """POST /v1/attach registers a page, a photo and a clip under the handles their keys derive; the page is
    then read by handle and the photo worked on by handle without a load; a handle other than the attachment's
    own is an infrastructure error, not an observation."""
    png = io.BytesIO()
    Image.new("RGB", (40, 20), "white").save(png, format="PNG")
    (tmp_path / "car.png").write_bytes(png.getvalue())
    page = Attachment("page", (corpus / "paris.html").as_uri(), "my-page", "Paris")
    photo = Attachment("image", str(tmp_path / "car.png"), file_key(tmp_path / "car.png"))
    app = real_app(corpus, roots=(str(tmp_path),))
    async with app.router.lifespan_context(app), await client_of(app) as tools:
        assert await tools.attach([page, photo], session="e1") == [page.handle, photo.handle]
        read = await tools.call("page_qa", {"url": page.handle, "question": "How tall?"}, session="e1")
        assert read.ok and read.payload["title"] == "Paris"
        found = await tools.call("image_ops", {"op": "find_text", "image": photo.handle}, session="e1")
        assert found.ok and found.payload["image_id"] == photo.handle, found.observation

    async def wrong(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"handles": ["d_000000"]})

    async with ToolClient("http://tools", transport=httpx.MockTransport(wrong)) as client:
        with pytest.raises(ToolServerError, match="differ"):
            await client.attach([page], session="e1")


async def test_two_attachments_sharing_a_handle_are_refused(corpus: Path) -> None:
    """Two keys whose 24-bit handles collide, attached in one call, are a 422 naming the handle, and neither is
    registered (before: the same handle came back twice, the second attachment silently replacing the first)."""
    seen: dict[str, str] = {}
    for n in itertools.count():  # about 5,000 keys give a collision
        key = f"page-{n}"
        first = seen.setdefault(handle_for("page", key), key)
        if first != key:
            break
    twins = [Attachment("page", f"http://127.0.0.1/{k}", k) for k in (first, key)]
    app = real_app(corpus)
    async with app.router.lifespan_context(app), await client_of(app) as tools:
        with pytest.raises(ToolServerError, match=f"422.*{twins[0].handle}"):
            await tools.attach(twins, session="e1")
        assert app.state.host.handles.listed("e1", "page") == []


async def test_a_rollout_registers_its_attachments_and_a_failed_registration_is_infra() -> None:
    """The rollout attaches the task's things before the policy's first turn (the session the calls use);
    when the server refuses them the episode is infra_failed with the reason, not scored."""
    seen: Counter[str] = Counter()

    async def server(request: httpx.Request) -> httpx.Response:
        seen[request.url.path + request.headers.get("X-Conductor-Session", "")[:4]] += 1
        if request.url.path == "/v1/attach":
            return httpx.Response(422, json={"detail": "no"})
        return await fake_tool_server(echo_tool).handle_async_request(request)

    clip = Attachment("video", "/clips/c.mp4", "sha256:c")
    task = RolloutTask("task", "What happens?", TOOLS, context=clip.line, attachments=(clip,))
    policy = ScriptedPolicy(lambda text, turn: call_text("video_summary", video=clip.handle))
    async with ToolClient("http://tools", transport=httpx.MockTransport(server)) as tools:
        episode = await rollout(task, policy, tools, ByteChatTokenizer(), RolloutConfig())
    assert episode.stop_reason == "infra_failed" and "attach" in (episode.infra_error or "")
    assert episode.turns == [] and seen["/v1/attachtask"] == 1


# ---------------------------------------------------------------- nothing the policy reads holds a path

FAMILIES = {  # family: (split, items) — one task each, played by its expert through the real tools
    "plate_reading": ("train", None),
    "plate_audit": ("train", 2),
    "multihop_pages": ("dev", None),
    "multihop_batch": ("dev", 2),
    "corpus_qa": ("dev", None),
    "research_corpus": ("dev", None),
    "video_qa": ("train", None),
}


def what_the_policy_read(episode, tokenizer) -> str:
    """The first prompt, every folded segment's prompt and every observation, as text."""
    parts = [tokenizer.decode(episode.prompt_ids)]
    for turn in episode.turns:
        parts += [tokenizer.decode(turn.prompt_ids), turn.observation_text]
    return "\n".join(parts)


@pytest.mark.slow
async def test_no_prompt_or_observation_of_any_family_holds_a_machine_path(
    shared_data, smollm2_path, tmp_path
):
    """Every family's first prompt and observations, played by its expert through the real tool server (real
    OCR, BM25, page_qa on the built-in model, ffmpeg), hold no absolute path and no file:// URL: the policy
    names photos, clips, pages and regions by handle, and every call it must write is one it saw."""
    from transformers import AutoTokenizer

    from tool_server.embedded import ToolAccess
    from training import tasks as task_data
    from training.experts import OraclePolicy
    from training.play import play, tool_session

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    tasks = [
        task_data.load_family(family, split, data_dir=shared_data, limit=1, items=items)[0]
        for family, (split, items) in FAMILIES.items()
    ]
    cfg = RolloutConfig(max_turns=10, max_new_tokens=320, max_context_tokens=4096)
    for task in tasks:  # corpus families search different corpora: one session each
        async with tool_session(
            [task], work_dir=tmp_path / task.family, access=ToolAccess(), data_dir=shared_data
        ) as (
            tools,
            ready,
        ):
            expert = OraclePolicy(ready[0], tokenizer)
            [[episode]] = await play(
                ready, lambda t, e=expert: e, tools=tools, tokenizer=tokenizer, cfg=cfg, max_concurrent=1,
                on_turn_for=lambda t, e=expert: e.observe,
            )  # fmt: skip
        read = what_the_policy_read(episode, tokenizer)
        assert episode.infra_error is None and episode.num_calls > 0, (task.family, episode.infra_error)
        assert not MACHINE_PATH.search(read), (task.family, MACHINE_PATH.search(read), read[-600:])
        for turn in episode.turns:
            for call in turn.calls:
                for key in ("url", "image", "video"):
                    assert "/" not in str(call.arguments.get(key, "")), (task.family, call.arguments)


@pytest.mark.slow
async def test_ask_shows_the_policy_handles_not_the_users_paths(shared_data, smollm2_path, tmp_path):
    """`conductor ask --image` and `ask` over the corpus: the prompt names the photo by handle, the opening
    call (forced for the untrained model) works on it, and no prompt or observation holds a path."""
    from transformers import AutoTokenizer

    from app.ask import AskOptions, ask
    from conductor.models import DEFAULT_MODEL

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    photo = next((shared_data / "images" / "plates" / "endtoend" / "eu").glob("*.jpg"))
    deep = tmp_path / ("long-folder-name-" * 4) / "car.jpg"
    deep.parent.mkdir(parents=True)
    deep.write_bytes(photo.read_bytes())
    image = AskOptions("What is the licence plate number?", image=deep, policy=DEFAULT_MODEL, max_turns=1)
    corpus = AskOptions("Which company released the SmolLM2 models?", policy=DEFAULT_MODEL, max_turns=1)
    for opts in (image, corpus):
        episode = await ask(opts)
        read = what_the_policy_read(episode, tokenizer)
        assert episode.infra_error is None and episode.turns[0].results[0].ok, episode.turns[
            0
        ].observation_text
        assert not MACHINE_PATH.search(read), (MACHINE_PATH.search(read), read[-600:])
        if opts is image:  # the handle comes from the photo's bytes: the same as the shared copy's
            assert f"Image: {handle_for('image', file_key(photo))}" in tokenizer.decode(episode.prompt_ids)


async def test_attach_refuses_unencodable_or_malformed_bodies_and_stays_healthy(corpus: Path) -> None:
    """/v1/attach parses strictly, like /v1/batch: a lone surrogate (it would be stored and shown later), NaN,
    an unknown kind, too many attachments or a source over 2,048 characters (page_qa's URL limit) are 422
    invalid_args that never echo the input; nothing is registered and the server keeps answering."""
    app = real_app(corpus)
    bodies = [
        b'{"attachments": [{"kind": "page", "source": "\\ud800", "key": "k"}]}',
        b'{"attachments": [{"kind": "page", "source": "http://a", "key": NaN}]}',
        b'{"attachments": [{"kind": "disk", "source": "/etc/passwd", "key": "k"}]}',
        b'{"attachments": ['
        + b",".join([b'{"kind": "page", "source": "http://a", "key": "k"}'] * 65)
        + b"]}",
        b'{"attachments": [{"kind": "page", "source": "http://a/' + b"x" * 2040 + b'", "key": "k"}]}',
    ]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8700") as http:
            for body in bodies:
                answer = await http.post("/v1/attach", content=body, headers={"X-Conductor-Session": "e1"})
                assert answer.status_code == 422 and answer.json()["error"]["kind"] == "invalid_args", body
                assert "passwd" not in answer.text and "\\ud800" not in answer.text
            assert (await http.get("/health")).status_code == 200
        assert app.state.host.handles.listed("e1", "page") == []
