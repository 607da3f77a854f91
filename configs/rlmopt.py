"""rlmopt settings: every field of `rlmopt.config.RLMOptConfig` (for configlib.load and sweeps;
`python -m rlmopt.run` holds the same dict as its `--config`, e.g. `--config.field_floor=0.1`)."""

from rlmopt.config import config_dict


def get_config(arg: str = ""):
    del arg  # no presets
    return config_dict()
