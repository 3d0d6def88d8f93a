"""Running a job: ``ddpwatch run`` (``launch``), the job's own output passed through
(``output``), why a job never started (``failure``), stopping a job's process tree (``stop``)
and the marks on alert lines (``emphasis``)."""
