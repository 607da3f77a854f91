"""GSPO baseline: one geometric-mean ratio per response.

Select with `--config=configs/gspo.py:PRESET[,VARIANT...]` (presets: paper, local, tiny; see base.py).
"""

from configs import base


def get_config(arg: str = "local"):
    preset, variants = base.parse_arg(arg)
    c = base.get_config(preset)
    c.train.granularity = "sequence"
    return base.apply_variants(c, variants)
