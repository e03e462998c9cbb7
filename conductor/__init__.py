"""Conductor's bottom layer: the machinery every runtime package shares.

settings.py, models.py, batching.py and cluster.py import none of the runtime packages (subagents, tool_server,
main_agent, training) and nothing of the application above them (app/); policies/ holds the shipped default
policy the model registry names. tests/test_layout.py checks it on the source.
"""
