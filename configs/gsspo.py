"""GSsPO: importance ratio and PPO clip per think+action sub-sequence (the paper's method).

Select with `--config=configs/gsspo.py:PRESET` (presets: paper, local, tiny).
"""

from configs import base


def get_config(preset: str = "local"):
    c = base.get_config(preset)
    c.train.granularity = "subsequence"
    return c
