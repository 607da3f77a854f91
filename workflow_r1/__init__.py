"""workflow_r1: pure-JAX training of LLM agents that build workflows by RL (Workflow-R1, GSsPO)."""
