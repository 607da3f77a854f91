"""workflow_r1: pure-JAX training of LLM agents that build workflows by RL (Workflow-R1, GSsPO)."""
import os as _os

# The runtime never imports torch, so transformers' "PyTorch was not found" advisory at import is
# noise for our users; it is an advisory only (tokenizers and configs need no torch).
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
