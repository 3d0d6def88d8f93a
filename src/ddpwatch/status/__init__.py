"""The status contract: what the server publishes (the status document, ``docs/status.md``)
and how a view gets it (``provider.StatusProvider``)."""
