"""Gathering the statistics: the calibration passes (passes), layer by layer (offload), which passes a plan takes
(routing), layer selection (selection), sequential fitting (sequential), the memory budget (memory) and data-
parallel ranks (distributed)."""
