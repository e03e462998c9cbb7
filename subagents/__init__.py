"""The frozen sub-agents the tool server hosts. Adding one: its file, an entry here, a test, a line in docs/layout.md."""

from subagents import image_ops, page_qa, search, video_summary

SUBAGENTS = {
    "page_qa": page_qa,
    "image_ops": image_ops,
    "video_summary": video_summary,
    "search": search,
}
