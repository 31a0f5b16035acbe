"""The `dse` command (main.py) and the commands it dispatches to."""
