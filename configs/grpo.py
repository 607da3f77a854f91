"""GRPO baseline: token ratios with verl's dual clip (c = 3), per-response token mean.

Select with `--config=configs/grpo.py:PRESET[,VARIANT...]` (presets: paper, local, tiny; see base.py).
"""

from configs import base


def get_config(arg: str = "local"):
    preset, variants = base.parse_arg(arg)
    c = base.get_config(preset)
    c.train.granularity = "token"
    return base.apply_variants(c, variants)
