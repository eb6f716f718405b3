"""The files the tool reads and writes itself: bounded reading (reading) and claimed output folders (folders).
Light: no torch."""
