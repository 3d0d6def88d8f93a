"""One module per ``ddpwatch`` subcommand, each with ``add_parser(subparsers)`` and
``run(args) -> int``; ``ddpwatch/cli.py`` lists them in ``COMMANDS`` and dispatches.

The modules import only the standard library and light ``ddpwatch`` modules at the
top; what a command needs (ZeroMQ, Textual, the server) is imported in its ``run``.
"""
