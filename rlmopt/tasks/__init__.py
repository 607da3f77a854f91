"""Tasks: `intent_code` (the synthetic diagnostic), `jsonl` (bring your own data), and the environment's
own prompts: `operator_env` (executor templates) and `policy_prompt` (the policy's user template),
with what those two share in `questions`."""
