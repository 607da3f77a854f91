"""The Workflow-R1 task as the policy meets it, with no model, sampler or network code:

- `tags.py`: the `<think>`, `<tool>`, `<info>`, `<answer>` tags, found in linear time;
- `protocol.py`: the prompt, the turn parser, the observation format and the episode limits;
- `operators.py`: the operator registry and the pools (`env.variant`);
- `prompt_sets.py`: the words of the prompts (`env.prompt_set`);
- `reward.py`: the rule-based format + exact-match reward;
- `config.py`: the `env` config section (`EnvConfig`).

The environment that drives it over the executor is `envs/workflow.py`; the word "env" names only
that environment and its config section.
"""
