"""What the server holds while it runs (`ToolHost`), how one tool call goes through it, and the tool schemas.

A call: validate the arguments (invalid -> an `invalid_args` result), take a lease on the tool's current
backend (so a hot swap mid-call does not pull the model away), look in the cache (cacheable tools only),
wait for a concurrency slot (bounded in time and number: tool_server/gates.py), run the sub-agent under the call
deadline, record metrics. `Runtime` is built per call, so the call keeps the LLM it started with. From the cache
lookup until it holds a slot the call tells its `Caller` it only waits: its connection may be reclaimed meanwhile.

Hot swap: a `Backend` counts its holders (tool slots pointing at it plus calls running on it) and closes
its LLM when the last one lets go, so a replaced model finishes its in-flight calls and is then closed.
Tools whose BackendConfigs are equal share one backend at start-up (one SmolLM2 in memory, one micro-batcher
for all four sub-agents).

Everything tool-specific comes from the sub-agent modules (subagents/common.py): their settings sections, whether
their results are cached (`CACHEABLE`), what they keep while the server runs (`start`: the image store, the
search index) and whether their settings can run on the model built for them (`check_model`, at start-up and
before a hot swap: page_qa's "extract" needs a model that scores). Nothing here names a tool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from conductor.settings import ConfigError
from subagents.common import Runtime, ToolFailure, ToolResponse, fail
from subagents.fetch import Fetcher
from subagents.handles import HandleKind, Handles, Ref, handle_for, looks_like_handle
from subagents.llm import LLM, BackendConfig
from subagents.transformers_llm import TransformersLLM
from tool_server.cache import ResultCache, cache_key
from tool_server.config import ServerConfig
from tool_server.gates import Caller, Overloaded, QueueBounds, ToolGate
from tool_server.limits import ToolMetrics

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Conductor-Session"
# What a caller learns of a bug: the kind and this sentence; the traceback goes to the server log only.
INTERNAL_MESSAGE = "internal error in the tool server (logged server-side)"


class SubAgent(Protocol):
    """The shape of a sub-agent module (see subagents/common.py)."""

    NAME: str
    DESCRIPTION: str
    CACHEABLE: bool
    Request: type[BaseModel]
    Response: type[ToolResponse]
    Config: type

    def start(self, cfg: Any, roots: tuple[str, ...]) -> Any: ...

    def check_model(self, cfg: Any, llm: LLM) -> None: ...

    def run(self, request: Any, cfg: Any, rt: Runtime[Any]) -> Awaitable[ToolResponse]: ...


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with `$ref`s inlined and `$defs`/`title` dropped: shorter prompts for a small policy."""
    defs = schema.get("$defs", {})
    cleaned: dict[str, Any] = _clean(schema, defs, seen=())
    return cleaned


def _clean(node: Any, defs: dict[str, Any], *, seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_clean(item, defs, seen=seen) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name in seen:
            raise ValueError(f"recursive schema through {name!r} cannot be inlined")
        merged = {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
        return _clean(merged, defs, seen=(*seen, name))
    out = {}
    for key, value in node.items():
        if key in ("title", "$defs", "handle"):  # "handle": which handles a field takes (`resolve_handles`)
            continue
        if key == "properties":  # property names are data, not keywords: a field may be called "title"
            out[key] = {prop: _clean(sub, defs, seen=seen) for prop, sub in value.items()}
        else:
            out[key] = _clean(value, defs, seen=seen)
    return out


def tool_schema(module: SubAgent) -> dict[str, Any]:
    """The OpenAI function schema of a sub-agent, generated from its Request model."""
    parameters = compact_schema(module.Request.model_json_schema())
    return {
        "type": "function",
        "function": {"name": module.NAME, "description": module.DESCRIPTION, "parameters": parameters},
    }


# What an invalid_args message names of the caller's input: field names cut to ECHO_CHARS, at most ERRORS_LISTED
# problems. Enough to fix a call; the input itself never comes back whole (a 1.9 MB name was echoed twice).
ECHO_CHARS = 40
ERRORS_LISTED = 5


def invalid_args_message(exc: ValidationError) -> str:
    """Pydantic's errors as one readable line (`errors_message`)."""
    return errors_message(exc.errors(include_url=False, include_input=False))


def errors_message(errors: Sequence[Mapping[str, Any]]) -> str:
    """Validation errors as one readable line: `question: Field required; k: Input should be ...`, the first
    ERRORS_LISTED of them with field names cut to ECHO_CHARS, and how many more there were."""
    parts = []
    for error in errors[:ERRORS_LISTED]:
        where = ".".join(echo(part) for part in error["loc"]) or "arguments"
        parts.append(f"{where}: {error['msg']}")
    more = len(errors) - ERRORS_LISTED
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def echo(value: object) -> str:
    """Something the caller sent, as a message may name it: its text, cut to ECHO_CHARS with a visible marker."""
    text = str(value)
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}...({len(text)} chars)"


def handle_fields(request_type: type[BaseModel]) -> dict[str, HandleKind]:
    """The Request fields that take a handle, and its kind: declared on the field as
    `json_schema_extra={"handle": "page"}` (page_qa's url, video_summary's video)."""
    fields = {}
    for name, info in request_type.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if "handle" in extra:
            fields[name] = extra["handle"]  # type: ignore[assignment]
    return fields


def resolve_handles(request: BaseModel, handles: Handles, session: str) -> BaseModel:
    """`request` with every handle in a handle field replaced by what it stands for in `session`, so the
    sub-agent opens the source and the result cache is keyed by it. A ToolFailure (invalid_args, naming the
    valid handles) for a handle the session was not shown or of another kind. Other values (a URL a user
    named) pass unchanged."""
    update = {}
    for name, kind in handle_fields(type(request)).items():
        value = getattr(request, name)
        if isinstance(value, str) and looks_like_handle(value):
            update[name] = handles.resolve(session, value, kind).source
    return request.model_copy(update=update) if update else request


# Failures to open what a request names: when it was named by handle, the message says which handle.
SOURCE_ERRORS = frozenset({"not_found", "blocked_url", "fetch_failed", "too_large", "unsupported_media"})


def naming_handles(response: ToolResponse, request: BaseModel) -> ToolResponse:
    """`response`, its error prefixed with the handles `request` named (`page d_3fa9c1: no such page file:
    'corpus/grpo.html'`) when it is about opening a source: the policy knows the handle, not where it led."""
    error = response.error
    named = [
        f"{kind} {getattr(request, name)}"
        for name, kind in handle_fields(type(request)).items()
        if isinstance(getattr(request, name), str) and looks_like_handle(getattr(request, name))
    ]
    if error is None or error.kind not in SOURCE_ERRORS or not named:
        return response
    response.error = error.model_copy(update={"message": f"{', '.join(named)}: {error.message}"})
    return response


class Backend:
    """One built LLM and its holders: the tool slots pointing at it plus the calls running on it."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.holders = 0

    def hold(self) -> None:
        self.holders += 1

    async def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            logger.info("closing backend %s: no tool or call holds it", self.llm.model_id)
            await self.llm.aclose()


class BackendSlot:
    """The backend currently answering one tool; `swap` replaces it without disturbing running calls."""

    def __init__(self, backend: Backend) -> None:
        backend.hold()
        self.backend = backend

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[LLM]:
        backend = self.backend
        backend.hold()
        try:
            yield backend.llm
        finally:
            await backend.release()

    async def swap(self, new: Backend) -> None:
        new.hold()
        old, self.backend = self.backend, new
        await old.release()

    async def close(self) -> None:
        await self.backend.release()


async def build_backends(
    cfg: ServerConfig, subagents: Mapping[str, SubAgent], llm_factory: Callable[[BackendConfig], LLM]
) -> dict[str, BackendSlot]:
    """One slot per tool; equal BackendConfigs share one LLM. Models load in a thread (seconds each). A tool
    whose settings cannot run on its model (`check_model`) is a ConfigError, every model closed again."""
    shared: dict[BackendConfig, Backend] = {}
    for name in subagents:
        model = cfg.tools[name].model
        if model not in shared:
            shared[model] = Backend(await asyncio.to_thread(llm_factory, model))
    try:
        for name, module in subagents.items():
            module.check_model(cfg.tools[name].config, shared[cfg.tools[name].model].llm)
    except ConfigError:
        for backend in shared.values():
            await backend.llm.aclose()
        raise
    return {name: BackendSlot(shared[cfg.tools[name].model]) for name in subagents}


@dataclass
class ToolHost:
    """Everything the running server holds; built by `start` in the app's lifespan, closed by `aclose`."""

    cfg: ServerConfig
    subagents: Mapping[str, SubAgent]
    llm_factory: Callable[[BackendConfig], LLM]
    fetcher: Fetcher
    states: dict[str, Any]
    cache: ResultCache
    slots: dict[str, BackendSlot]
    gates: dict[str, ToolGate]
    metrics: dict[str, ToolMetrics]
    handles: Handles

    @classmethod
    async def start(
        cls,
        cfg: ServerConfig,
        *,
        subagents: Mapping[str, SubAgent],
        llm_factory: Callable[[BackendConfig], LLM],
    ) -> ToolHost:
        names = list(subagents)
        roots = cfg.files.roots
        queue = QueueBounds(total=cfg.max_queued_calls, per_peer=cfg.max_queued_calls_per_peer)
        states = {}
        for name, module in subagents.items():  # each tool's own state; blocking (an index build): a thread
            states[name] = await asyncio.to_thread(module.start, cfg.tools[name].config, roots)
        return cls(
            cfg=cfg,
            subagents=subagents,
            llm_factory=llm_factory,
            fetcher=Fetcher(cfg.fetch, roots=roots),
            states=states,
            cache=ResultCache(cfg.cache),
            slots=await build_backends(cfg, subagents, llm_factory),
            gates={name: ToolGate(name, cfg.tools[name].limits, queue=queue) for name in names},
            metrics={name: ToolMetrics() for name in names},
            handles=Handles(),
        )

    async def aclose(self) -> None:
        for slot in self.slots.values():
            await slot.close()
        await self.fetcher.aclose()

    async def call(
        self, name: str, arguments: bytes | Mapping[str, Any], *, session: str, caller: Caller | None = None
    ) -> ToolResponse:
        """Run tool `name` on raw JSON or parsed arguments for `caller` (None: one with no address). Raises
        Overloaded when the tool's queue is full or past its deadline (gates.py)."""
        module = self.subagents[name]
        start = time.perf_counter()
        error: str | None = "internal"  # what is recorded if a bug escapes
        try:
            response = await self._call(module, arguments, session=session, caller=caller or Caller(""))
            error = response.error.kind if response.error is not None else None
        except Overloaded:
            error = "overloaded"
            raise
        except asyncio.CancelledError:  # the caller went away (its deadline passed, the server is stopping)
            error = "cancelled"
            logger.debug("%s call cancelled: its caller went away", name)
            raise
        finally:
            self.metrics[name].record(seconds=time.perf_counter() - start, error=error)
        for handle, ref in response.refs():  # what the caller was shown, cached answers too
            self.handles.add(session, handle, ref)
        response.latency_ms = (time.perf_counter() - start) * 1000
        return response

    def attach(self, session: str, attachments: list[tuple[HandleKind, str, str, str]]) -> list[str]:
        """Register what a user or a task attached, (kind, source, key, label) each, in `session` before its
        first turn; the handles, in order (`handle_for(kind, key)`: the caller can know them beforehand).
        Sources are checked when a tool opens them, like any argument. ValueError, nothing registered, when two
        keys share a handle (24 bits: subagents/handles.py): one would silently stand for the other."""
        keys: dict[str, str] = {}
        for kind, _, key, _ in attachments:
            handle = handle_for(kind, key)
            if keys.setdefault(handle, key) != key:
                raise ValueError(
                    f"keys {echo(keys[handle])!r} and {echo(key)!r} share the handle {handle}: give one another key"
                )
        for kind, source, key, label in attachments:
            self.handles.add(session, handle_for(kind, key), Ref(kind, source, label))
        return [handle_for(kind, key) for kind, _, key, _ in attachments]

    async def call_as_result(
        self, name: str, arguments: Mapping[str, Any], *, session: str, caller: Caller | None = None
    ) -> ToolResponse:
        """Like `call`, but every outcome is a result (batch items, MCP): an overload refusal is `overloaded`,
        and a bug escaping the call is this call's own `internal` result, its traceback logged here, so one
        bad call never fails the calls sent with it and no exception text reaches the caller."""
        try:
            return await self.call(name, arguments, session=session, caller=caller)
        except Overloaded as exc:
            return fail(self.subagents[name].Response, "overloaded", str(exc))
        except Exception:  # the boundary of one call: the bug is logged whole and answered as `internal`
            logger.exception("internal error in a %s call", name)
            return fail(self.subagents[name].Response, "internal", INTERNAL_MESSAGE)

    async def _call(
        self, module: SubAgent, arguments: bytes | Mapping[str, Any], *, session: str, caller: Caller
    ) -> ToolResponse:
        try:
            if isinstance(arguments, bytes):
                request = module.Request.model_validate_json(arguments)
            else:
                request = module.Request.model_validate(arguments)
        except ValidationError as exc:
            return fail(module.Response, "invalid_args", invalid_args_message(exc))
        try:
            resolved = resolve_handles(request, self.handles, session)
        except ToolFailure as exc:
            return module.Response(ok=False, error=exc.error)
        with caller.waiting():  # until it holds a slot (`_run`), or for an equal call's result
            response = await self._compute(module, resolved, session=session, caller=caller)
        return naming_handles(response, request)

    async def _compute(
        self, module: SubAgent, request: BaseModel, *, session: str, caller: Caller
    ) -> ToolResponse:
        """The response to a request whose handles are resolved: from the cache, or run."""
        async with self.slots[module.NAME].lease() as llm:
            rt = Runtime(
                llm=llm, fetcher=self.fetcher, state=self.states[module.NAME], roots=self.cfg.files.roots,
                session=session, count_tokens=llm.count_tokens, handles=self.handles,
            )  # fmt: skip
            compute = lambda: self._run(module, request, rt, caller)  # noqa: E731
            if not module.CACHEABLE or not self.cfg.cache.enabled:
                return await compute()
            settings = repr(self.cfg.tools[module.NAME].config)
            key = cache_key(module.NAME, llm.model_id, request, settings=settings)
            return await self.cache.get_or_compute(module.NAME, key, module.Response, compute)

    async def _run(self, module: SubAgent, request: BaseModel, rt: Runtime, caller: Caller) -> ToolResponse:
        settings = self.cfg.tools[module.NAME]
        deadline = settings.limits.call_timeout_s
        async with self.gates[module.NAME].slot(caller):
            try:
                async with asyncio.timeout(deadline):
                    return await module.run(request, settings.config, rt)
            except TimeoutError:
                return fail(module.Response, "timeout", f"{module.NAME} gave no result within {deadline:g} s")

    async def swap_backend(self, name: str, model: BackendConfig) -> str:
        """Build `model` in a thread and make it answer `name`'s new calls; returns its model id. ConfigError
        (the model built and closed again, the old one still answering) when the tool's settings cannot run on it."""
        llm = await asyncio.to_thread(self.llm_factory, model)
        try:
            self.subagents[name].check_model(self.cfg.tools[name].config, llm)
        except ConfigError:
            await llm.aclose()
            raise
        backend = Backend(llm)
        await self.slots[name].swap(backend)
        logger.info("%s now answered by %s", name, backend.llm.model_id)
        return backend.llm.model_id

    def model_ids(self) -> dict[str, str]:
        return {name: slot.backend.llm.model_id for name, slot in self.slots.items()}

    def metrics_snapshot(self) -> dict[str, Any]:
        return {"tools": {name: self._tool_metrics(name) for name in self.subagents}}

    def _tool_metrics(self, name: str) -> dict[str, Any]:
        gate, stats, llm = self.gates[name], self.cache.stats[name], self.slots[name].backend.llm
        return {
            **self.metrics[name].snapshot(),
            "cache": {"hits": stats.hits, "misses": stats.misses, "hit_rate": stats.hit_rate},
            "queue_depth": gate.waiting,
            "in_flight": gate.running,
            "backend_queue_depth": llm.queue_depth if isinstance(llm, TransformersLLM) else None,
            "model": llm.model_id,
        }
