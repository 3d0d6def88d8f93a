"""Diagnosis: pure functions from the server's state to alerts, with their history and the
verdict of a run. ``rules`` holds the rule families and the facts they share, ``knowledge``
the error texts torch and NCCL print, ``alerts`` and ``history`` what a rule raises and how
raises become episodes, ``verdict`` how a run ended. Imports the server's records, never an
output or a view."""
