"""rlmopt: prompt optimisation by a recursive-LM agent over a deterministic harness.

The harness (`harness.py`, `gates.py`, `selection.py`) owns data, scoring, budget, commit rules
and the final pick; the agent (`agent.py`) writes Python in a sandboxed REPL (`sandbox/`) whose
tools (`tools.py`) call back into the harness. Entry point: `python -m rlmopt.run`.
See docs/rlmopt.md.
"""
