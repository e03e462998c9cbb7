"""tool_server.embedded: the one way `ask`, training, evaluation and SFT reach their tools."""

from __future__ import annotations

from pathlib import Path

import pytest

from subagents.common import Files
from tests.fake_openai_server import unused_port
from tool_server.client import ToolServerError
from tool_server.config import ServerConfig
from tool_server.embedded import ToolAccess, embedded_config, open_tools


def test_embedded_config_opens_exactly_what_the_callers_inputs_need(tmp_path: Path) -> None:
    """The caller's folders become readable (added to the base's, once each), loopback becomes fetchable only
    when asked, and a corpus is both searched and readable (page_qa opens search hits)."""
    base = ServerConfig(files=Files(roots=("/srv/shared",)))
    plain = embedded_config(base)
    assert plain == base
    cfg = embedded_config(base, roots=["/data/plates", "/srv/shared"], loopback=True, corpus=tmp_path)
    assert cfg.files.roots == ("/srv/shared", "/data/plates", str(tmp_path))
    assert cfg.fetch.allow_private_cidrs == ("127.0.0.0/8",)
    assert cfg.tools["search"].config.corpus_dir == str(tmp_path)
    assert cfg.tools["page_qa"] == base.tools["page_qa"]


async def test_a_url_nobody_answers_is_a_tool_server_error_at_once() -> None:
    """`[tools] url` pointing at nothing fails when the tools are opened, naming the URL, not mid-episode."""
    url = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(ToolServerError, match="unreachable"):
        async with open_tools(ToolAccess(url=url)):
            pass


@pytest.mark.slow
async def test_the_in_process_server_reads_the_callers_folders_and_its_config(
    shared_data: Path, tmp_path: Path
) -> None:
    """Without a URL the real tool server runs in this process: it loads a photo from a folder the caller
    named, refuses one outside it, and starts from `access.config` (here a store whose sessions can name one
    image: the second photo's load forgets the first)."""
    plates = shared_data / "images" / "plates" / "endtoend" / "eu"
    photos = sorted(plates.glob("*.jpg"))[:2]
    config = tmp_path / "server.toml"
    config.write_text("[image_ops]\nmax_recipes = 1\n")
    async with open_tools(ToolAccess(config=config), roots=[str(plates)]) as tools:
        first = await tools.call("image_ops", {"op": "load", "image": str(photos[0])}, session="s")
        second = await tools.call("image_ops", {"op": "load", "image": str(photos[1])}, session="s")
        evicted = await tools.call(
            "image_ops", {"op": "read", "image": first.payload["image_id"]}, session="s"
        )
        outside = await tools.call("image_ops", {"op": "load", "image": str(config)}, session="s")
    assert first.ok and second.ok, (first.observation, second.observation)
    assert evicted.error is not None and evicted.error.kind == "invalid_args"  # forgotten
    assert outside.error is not None and outside.error.kind == "invalid_args"
