"""Diagnosis: pure functions from the server's state to alerts, with their history and the
verdict of a run. ``facts`` holds the attribution model the rules share (one module per
model), ``rules`` the rule families, their registry and the ticking ``Diagnosis``, ``text``
the words alerts are written in, ``knowledge`` the error texts torch and NCCL print,
``alerts`` and ``history`` what a rule raises and how raises become episodes, ``verdict``
how a run ended. Imports the server's records, never an output or a view."""
