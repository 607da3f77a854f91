"""The agent's sandboxed REPL: `worker.py` (the isolated child) and `repl.py` (its parent side)."""
