"""GRPO baseline: token ratios with verl's dual clip (c = 3), per-response token mean.

Select with `--config=configs/grpo.py:PRESET` (presets: paper, local, tiny).
"""

from configs import base


def get_config(preset: str = "local"):
    c = base.get_config(preset)
    c.train.granularity = "token"
    return c
