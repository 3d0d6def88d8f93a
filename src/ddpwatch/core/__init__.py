"""The shared kernel: what the agent, the relay, the server and the views all use. The wire
format (``protocol``), the names that are contracts (``vocabulary``), ``CUDA_VISIBLE_DEVICES``
as CUDA reads it (``devices``), rank lists written short (``ranges``), where a rank sends, free
ports and who holds one (``ports``, ``port_holder``) and CurveZMQ keys (``security``). Imports
nothing else of ddpwatch, and no torch."""
