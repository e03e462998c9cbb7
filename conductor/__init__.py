"""Conductor's bottom layer and its command line.

settings.py, models.py, batching.py and cluster.py are the machinery the four runtime packages (main_agent, subagents,
tool_server, training) share; they import none of those packages. cli.py is the one top: the `conductor`
command, which imports the runtime packages inside each subcommand, and display.py its terminal view (the only
other module that prints). tests/test_layout.py checks both rules on the source.
"""
