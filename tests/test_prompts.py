"""The prompt side of the format (main_agent.prompts), tested together with the parser and the real chat template."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from main_agent.parse import parse_completion
from main_agent.prompts import (
    end_of_turn_id,
    next_item,
    observation_ids,
    prompt_messages,
    record_progress,
    render_observation,
    render_prompt,
    system_prompt,
)
from main_agent.types import ParseError, Record, ToolResult

# A small literal /v1/tools payload in the shape the tool server returns (pydantic-generated schemas).
TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "page_qa",
            "description": "Answer a question about one web page.",
            "parameters": {
                "type": "object",
                "properties": {
                    "url": {
                        "type": "string",
                        "title": "Url",
                        "examples": ["https://en.wikipedia.org/wiki/Paris"],
                    },
                    "question": {"type": "string", "title": "Question"},
                },
                "required": ["url", "question"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "image_ops",
            "description": "Crop, zoom or read text in an image.",
            "parameters": {
                "type": "object",
                "properties": {
                    "op": {"enum": ["crop", "zoom", "ocr"], "type": "string"},
                    "image": {"type": "string"},
                    "box": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]},
                    "scale": {"type": "number", "default": 2.0},
                },
                "required": ["op", "image"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "video_summary",
            "description": "Summarise a video or answer a question about it.",
            "parameters": {
                "type": "object",
                "properties": {"video": {"type": "string"}, "question": {"type": "string", "default": ""}},
                "required": ["video"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the local corpus.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "k": {"type": "integer", "default": 5}},
                "required": ["query"],
            },
        },
    },
]
NAMES = [t["function"]["name"] for t in TOOLS]


def result(name: str, observation: str, *, ok: bool = True) -> ToolResult:
    return ToolResult(name, ok, observation, None if ok else "not_found", 12.5, 300, 20, False, None)


def test_system_prompt_lists_every_tool_with_its_arguments() -> None:
    """Each served tool appears on its own line with every argument name, its type, and optional markers."""
    prompt = system_prompt(TOOLS, max_calls_per_turn=3)
    lines = prompt.splitlines()
    for tool in TOOLS:
        function = tool["function"]
        line = next(x for x in lines if x.startswith(f"- {function['name']}("))
        assert function["description"] in line
        for arg in function["parameters"]["properties"]:
            assert re.search(rf"\b{arg}\??: ", line), (arg, line)
    assert '- image_ops(op: "crop"|"zoom"|"ocr", image: str, box?: list[int], scale?: float):' in prompt
    assert "- search(query: str, k?: int): Search the local corpus." in prompt
    assert "up to 3 calls per turn" in prompt and "<answer>" in prompt
    assert "one call per turn" in system_prompt(TOOLS, max_calls_per_turn=1)


def test_argument_types_from_schema_variants() -> None:
    """Nullable type lists, nested models ($ref), consts and untyped properties get compact type names."""
    tool = {
        "type": "function",
        "function": {
            "name": "t",
            "description": "D.",
            "parameters": {
                "properties": {
                    "a": {"type": ["string", "null"]},
                    "b": {"$ref": "#/$defs/Box"},
                    "c": {"const": "x"},
                    "d": {},
                    "e": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "string"}]},
                },
                "required": ["b"],
            },
        },
    }
    prompt = system_prompt([tool], max_calls_per_turn=2)
    assert '- t(a?: str, b: dict, c?: "x", d?: any, e?: str|int): D.' in prompt
    assert '<tool_call>{"name": "t", "arguments": {"b": {}}}</tool_call>' in prompt


def test_system_prompt_is_short() -> None:
    """Four tools fit in a small budget of characters (about 200 tokens): the policy's context is small."""
    assert len(system_prompt(TOOLS, max_calls_per_turn=2)) < 900


def test_example_call_in_prompt_parses_to_a_valid_call() -> None:
    """The prompt's example call, fed to the parser, is one valid call with all required arguments."""
    prompt = system_prompt(TOOLS, max_calls_per_turn=1)
    example = re.search(r"<tool_call>.*?</tool_call>", prompt)
    assert example is not None
    turn = parse_completion(example.group(), tool_names=NAMES)
    assert turn.errors == [] and len(turn.calls) == 1
    call = turn.calls[0]
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
    assert set(schema["required"]) <= set(call.arguments) <= set(schema["properties"])
    assert (
        call.arguments["url"] == "https://en.wikipedia.org/wiki/Paris"
    )  # schema examples win over placeholders


def test_example_call_uses_enum_and_placeholders() -> None:
    """Without examples, the example call picks the first enum value and typed placeholders, and still parses."""
    prompt = system_prompt(TOOLS[1:2], max_calls_per_turn=1)
    turn = parse_completion(prompt, tool_names=NAMES)
    assert [(c.name, c.arguments) for c in turn.calls] == [("image_ops", {"op": "crop", "image": "..."})]


def test_render_observation() -> None:
    """Each result is one <tool_response> line in call order, then parse errors, compactly."""
    text = render_observation(
        [result("search", "3 passages"), result("page_qa", "error (not_found): 404", ok=False)],
        parse_errors=[ParseError("unknown_tool", "unknown tool 'x'", "<tool_call>...")],
    )
    assert text == (
        "<tool_response>search: 3 passages</tool_response>\n"
        "<tool_response>page_qa: error (not_found): 404</tool_response>\n"
        "<tool_response>error (unknown_tool): unknown tool 'x'</tool_response>"
    )


def test_a_records_acknowledgement_names_the_next_item_or_says_all_are_recorded() -> None:
    """After a record the observation names the first unrecorded item with its context line and how many are
    left, or says every item is recorded; a turn without records shows no progress line."""
    context = "Image 1: img_aaaaaa\nImage 2: img_bbbbbb\nImage 3: img_cccccc"
    assert record_progress(context, ["A1", None, None]) == "next: item 2 (Image 2: img_bbbbbb), 2 of 3 left"
    assert record_progress(context, ["A1", None, "C3"]) == "next: item 2 (Image 2: img_bbbbbb), 1 of 3 left"
    assert record_progress(context, ["A1", "B2", "C3"]) == "all 3 recorded: answer to finish"
    text = render_observation([], records=[Record(1, "A1", "")], progress="all 1 recorded: answer to finish")
    assert text.splitlines() == [
        "<tool_response>recorded 1: A1</tool_response>",
        "<tool_response>all 1 recorded: answer to finish</tool_response>",
    ]
    assert (
        render_observation([result("search", "x")], progress="ignored")
        == "<tool_response>search: x</tool_response>"
    )


class ByteChatML:
    """A byte-level tokenizer with SmolLM2's ChatML template: ids 0-2 are special, byte b is id b + 3."""

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in re.split(r"(<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>)", text):
            ids += [self.specials.index(piece)] if piece in self.specials else [b + 3 for b in piece.encode()]
        return ids

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        add_generation_prompt: bool,
        tokenize: bool,
        return_dict: bool,
    ) -> list[int]:
        assert tokenize and not return_dict
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
        return self.encode(text + ("<|im_start|>assistant\n" if add_generation_prompt else ""))


def check_token_append_identity(tokenizer, encode) -> None:
    """prompt + completion + observation ids == the template's rendering of the whole conversation, two turns."""
    question = "How tall is the Eiffel tower?"
    messages = prompt_messages(question, TOOLS, max_calls_per_turn=2, extra_context="Image: img_1")
    ids = render_prompt(tokenizer, question, TOOLS, max_calls_per_turn=2, extra_context="Image: img_1")
    eot = end_of_turn_id(tokenizer)
    turns = [
        ('Searching.\n<tool_call>{"name": "search", "arguments": {"query": "eiffel"}}</tool_call>', True),
        (
            '<tool_call>{"name": "page_qa", "arguments": {"url": "u", "question": "height?"}}</tool_call>',
            False,
        ),
    ]
    for i, (completion, ended) in enumerate(turns):
        completion_ids = encode(completion) + ([eot] if ended else [])
        results = [result("search", f"passage {i}: 330 m")]
        obs = observation_ids(tokenizer, render_observation(results), completion_ids=completion_ids)
        ids += completion_ids + obs
        messages += [
            {"role": "assistant", "content": completion},
            {"role": "user", "content": render_observation(results)},
        ]
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)


def test_token_append_identity_byte_tokenizer() -> None:
    """The append identity holds for a ChatML template, with and without the end-of-turn id sampled."""
    tokenizer = ByteChatML()
    assert end_of_turn_id(tokenizer) == 2
    check_token_append_identity(tokenizer, tokenizer.encode)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.slow
def test_token_append_identity_smollm2(smollm2_tokenizer) -> None:
    """With SmolLM2's real tokenizer and template, appended ids equal the full conversation's rendering."""
    assert smollm2_tokenizer.convert_ids_to_tokens(end_of_turn_id(smollm2_tokenizer)) == "<|im_end|>"
    check_token_append_identity(
        smollm2_tokenizer, lambda text: smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.slow
def test_smollm2_template_ignores_tools(smollm2_tokenizer) -> None:
    """SmolLM2's template renders the same ids with or without `tools=`, so the tool list must live in our
    system prompt (the decision documented in main_agent.prompts); the rendered prompt names every tool."""
    messages = prompt_messages("q?", TOOLS, max_calls_per_turn=2)
    plain = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with_tools = smollm2_tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(plain) == list(with_tools)
    rendered = smollm2_tokenizer.decode(render_prompt(smollm2_tokenizer, "q?", TOOLS, max_calls_per_turn=2))
    assert rendered.startswith("<|im_start|>system\nAnswer") and rendered.endswith("<|im_start|>assistant\n")
    assert all(f"- {name}(" in rendered for name in NAMES)


def test_a_folded_segment_names_the_next_unrecorded_item_and_its_handle():
    """After a fold the prompt says which item comes next and repeats its line of the context (with the
    photo's handle), so a small policy never has to work out where it was; nothing when all are recorded."""
    context = "Image 1: img_aaaaaa\nImage 2: img_bbbbbb\nImage 3: img_cccccc"
    assert next_item(context, ["ABC123", None, None]) == "\nNext: item 2 (Image 2: img_bbbbbb)"
    assert next_item(context, ["ABC123", None, "XYZ9"]) == "\nNext: item 2 (Image 2: img_bbbbbb)"
    assert next_item(context, ["A", "B", "C"]) == ""
    questions = "Question 1: Who?\nPage: d_111111 A\nQuestion 2: When?\nPage: d_222222 B"
    assert next_item(questions, ["x", None]) == "\nNext: item 2 (Question 2: When?)"
