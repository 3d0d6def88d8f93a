"""The dashboard's screens: the dashboard itself, help, the timeline, the job's output and the
quit question. A screen lays widgets out and reacts to keys; it reads data through ``data``."""
