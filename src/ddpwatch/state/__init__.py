"""What the server knows of a job, below the diagnosis: each rank's record (``records``), the
job (``state.ServerState``) and its indexes (``waits``, ``relays``, ``host_memory``,
``step_times``, ``devices``, ``marks``, ``flags``, ``claims``). The collector writes it, the
rules read it; it imports only ``core`` and ``status``, so every arrow between the server,
the diagnosis and it points one way."""
