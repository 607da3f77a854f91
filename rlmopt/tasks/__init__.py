"""Tasks: `intent_code` (the synthetic diagnostic) and `jsonl` (bring your own data)."""
