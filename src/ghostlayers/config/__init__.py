"""What a run is asked to do: the API's settings and their checks (settings), the jobs' recipes (recipes). Light:
the command line imports them before any heavy import."""
