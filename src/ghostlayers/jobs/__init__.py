"""Whole jobs: prune, eval and heal (runs), and the depth sweep (sweep)."""
