"""GSPO baseline: one geometric-mean ratio per response.

Select with `--config=configs/gspo.py:PRESET` (presets: paper, local, tiny).
"""

from configs import base


def get_config(preset: str = "local"):
    c = base.get_config(preset)
    c.train.granularity = "sequence"
    return c
