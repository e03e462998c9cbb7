"""The application on top of Conductor: what a user runs and sees.

cli.py is the `conductor` command (its command groups in cli_serve.py, cli_ask.py and cli_train.py, what they
share in cli_common.py), display.py its live terminal view, ask.py the research assistant behind `conductor
ask`, trace.py the HTML trace viewer. They import the runtime packages (main_agent, subagents,
tool_server, training) and the bottom layer (conductor); nothing imports them (tests/test_layout.py).
"""
