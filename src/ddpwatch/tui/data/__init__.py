"""The dashboard's data, without Textual: where status documents come from (``sources``), the
rows and their order (``model``, ``large_job``), what the view remembers of a run (``story``,
``sparklines``)."""
