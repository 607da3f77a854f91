"""GSsPO: importance ratio and PPO clip per think+action sub-sequence (the paper's method).

Select with `--config=configs/gsspo.py:PRESET[,VARIANT...]` (presets: paper, local, tiny; see base.py).
"""

from configs import base


def get_config(arg: str = "local"):
    preset, variants = base.parse_arg(arg)
    c = base.get_config(preset)
    c.train.granularity = "subsequence"
    return base.apply_variants(c, variants)
