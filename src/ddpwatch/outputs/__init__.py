"""Outputs: what only reads a status document or a recording (the end-of-run summary,
notifications, Prometheus metrics, the report in text, HTML and SVG). Imports the status
contract (the verdict the server judged is one of its fields) and the recording reader,
never the collector, the state or the diagnosis."""
