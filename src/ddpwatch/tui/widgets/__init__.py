"""The dashboard's widgets: the header, the rank table and its columns, the alerts panel, the
detail pane and the stack panel. A widget draws what it is given; it fetches nothing."""
