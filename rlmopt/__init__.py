"""rlmopt: prompt optimization of the Workflow-R1 operator environment by an agent LLM in a REPL.

Not built yet. The harness (scoring, Pareto selection, regression floor, significance and diagnose
gates, polish stage, sealed test split) will call the same executor client as the RL trainer
(`workflow_r1.executor.client`) with candidate prompt templates.
"""
