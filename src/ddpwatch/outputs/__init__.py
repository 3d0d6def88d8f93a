"""Outputs: what only reads a status document or a recording (the end-of-run summary,
notifications, Prometheus metrics, the report in text, HTML and SVG). Imports the status
contract, the recording reader and the verdict, never the collector, the state or a rule."""
