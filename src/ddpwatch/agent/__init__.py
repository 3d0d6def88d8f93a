"""The agent that runs inside each training rank."""
