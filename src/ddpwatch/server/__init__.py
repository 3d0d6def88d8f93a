"""The collector side: no torch needed."""
