"""Test doubles for the main agent: a byte-level ChatML tokenizer, a scripted policy, a fake tool server.

None of them needs weights or network. The fake tool server is an `httpx.MockTransport`, so the real
`ToolClient` (timeouts, retries, error mapping) runs unchanged over it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

import httpx

from main_agent.policy import Sample
from subagents.handles import handle_for

SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257}
SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))


class ByteChatTokenizer:
    """Bytes are ids 0-255; `<|im_start|>` 256, `<|im_end|>` 257 (end of turn). ChatML template."""

    eos_token_id = SPECIALS["<|im_end|>"]
    pad_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        pos = 0
        for match in SPECIAL_RE.finditer(text):
            ids += list(text[pos : match.start()].encode())
            ids.append(SPECIALS[match.group()])
            pos = match.end()
        return ids + list(text[pos:].encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        names = {v: k for k, v in SPECIALS.items()}
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode(errors="replace"))
            buf = bytearray()
            out.append("" if skip_special_tokens else names[i])
        out.append(buf.decode(errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages, *, add_generation_prompt=False, tokenize=True, return_dict=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


Reply = Callable[[str, int], str]
"""(conversation so far as text, turn index) -> the policy's next completion text."""


class ScriptedPolicy:
    """Replies chosen by a function of the history; records every prompt it was given."""

    def __init__(self, reply: Reply, tokenizer: ByteChatTokenizer | None = None) -> None:
        self.reply = reply
        self.tokenizer = tokenizer or ByteChatTokenizer()
        self.eos_token_id = self.tokenizer.eos_token_id
        self.version = 0
        self.prompts: list[list[int]] = []
        self.samples: list[Sample] = []

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample:
        self.prompts.append(list(prompt_ids))
        text = self.reply(self.tokenizer.decode(prompt_ids), len(self.prompts) - 1)
        ids = (self.tokenizer.encode(text) + [self.eos_token_id])[:max_new_tokens]
        finish = "stop" if ids[-1] == self.eos_token_id else "length"
        sample = Sample(ids, [-0.5] * len(ids), text, finish)
        self.samples.append(sample)
        return sample

    async def aclose(self) -> None:
        return None


def tool_schema(name: str, **properties: str) -> dict[str, object]:
    props = {k: {"type": v} for k, v in properties.items()}
    params = {"type": "object", "properties": props, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": f"The {name} tool.", "parameters": params},
    }


TOOLS = [
    tool_schema("search", query="string"),
    tool_schema("page_qa", url="string", question="string"),
    tool_schema("image_ops", op="string", image="string"),
    tool_schema("video_summary", video="string"),
]

ToolHandler = Callable[[str, dict[str, object]], Awaitable[dict[str, object]]]


async def echo_tool(name: str, arguments: dict[str, object]) -> dict[str, object]:
    """A successful result whose observation echoes the call compactly."""
    return ok_result(f"{name} saw {json.dumps(arguments, sort_keys=True)}")


def ok_result(observation: str, *, latency_ms: float = 5.0, tokens_read: int = 100) -> dict[str, object]:
    return {
        "ok": True,
        "error": None,
        "observation": observation,
        "latency_ms": latency_ms,
        "tokens_read": tokens_read,
        "tokens_returned": len(observation) // 4,
        "cached": False,
    }


def fake_tool_server(handler: ToolHandler = echo_tool, *, delay_s: float = 0.0) -> httpx.MockTransport:
    """/v1/tools, /health and /v1/tools/{name} answered by `handler` (after `delay_s`, to show concurrency);
    /v1/attach answers the handles the attachments derive, as the real server does."""

    async def respond(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/tools":
            return httpx.Response(200, json=TOOLS)
        if path == "/health":
            return httpx.Response(200, json={"ok": True})
        if path == "/v1/attach":
            attached = json.loads(request.content)["attachments"]
            return httpx.Response(200, json={"handles": [handle_for(a["kind"], a["key"]) for a in attached]})
        name = path.rsplit("/", 1)[-1]
        if name not in {t["function"]["name"] for t in TOOLS}:  # type: ignore[index]
            return httpx.Response(404, json={"detail": "unknown tool"})
        await asyncio.sleep(delay_s)
        return httpx.Response(200, json=await handler(name, json.loads(request.content)))

    return httpx.MockTransport(respond)


def call_text(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
