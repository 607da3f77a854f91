"""`python -m workflow_r1.aot --config=configs/gsspo.py:paper --topology=v5p-16`: the AOT fit check
of `workflow_r1.aot` behind flags. Exit 0: every program fits; 1: one does not (the one-line error
names the config keys to change); 2: a bad topology, mesh or config.
"""
from __future__ import annotations

import os
import sys

# Compile-only: no TPU backend is started (none is needed, and one on a TPU VM may be busy
# training), and libtpu's one-process lock does not keep two checks from running at once. Set
# before JAX is imported, which reads them.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from workflow_r1 import aot, configlib  # noqa: E402
from workflow_r1.aot import bound  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", default="configs/gsspo.py:paper",
                                          help_string="config file and preset, e.g. configs/gsspo.py:paper")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p-16", "TPU slice: v5p-16, v5e-16, v6e-8, ... or v5p:2x2x2")
_PROGRAMS = flags.DEFINE_list("programs", [], "which programs to compile (default: update,score,sync and the "
                              "engine's own: step with rollout.max_tokens_per_step > 0, else prefill,decode)")
_HEADROOM = flags.DEFINE_float("headroom", 0.95, "fraction of HBM a program may use")
_RESPONSE = flags.DEFINE_float("response_tokens", -1, "step bound: mean tokens after the prompt per row, "
                               "observations included (-1: the whole rollout.max_response_tokens)")
_OBSERVED = flags.DEFINE_float("observation_share", bound.OBSERVATION_SHARE,
                               "step bound: the share of those tokens that are observations (prefilled, not "
                               "decoded); default: our local runs' (docs/replicate.md)")
_PROMPT = flags.DEFINE_integer("prompt_tokens", bound.PROMPT_TOKENS, "step bound: mean opening prompt, tokens")
_TEMPLATE = flags.DEFINE_integer("template_tokens", bound.TEMPLATE_TOKENS,
                                 "step bound: the prompt's prefix that every question shares, tokens")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit(f"error: unexpected arguments {argv[1:]}")
    try:
        run = aot.Sections.from_config(_CONFIG.value)
        chip, topology = aot.topology_string(_TOPOLOGY.value)
        devices = aot.tpu_devices(topology)
        arch = aot.architecture(run)
        programs = _PROGRAMS.value or ["update", "score", "sync",
                                       *(["step"] if run.rollout.max_tokens_per_step else ["prefill", "decode"])]
        reports, info = aot.compile_all(run, arch, devices, programs, host=aot.host_devices(chip, devices))
    except aot.DoesNotFit as e:
        print(str(e), file=sys.stderr)
        raise SystemExit(1) from None
    except (aot.AotError, ValueError) as e:
        print(f"error: {e}" if not str(e).startswith("error:") else str(e), file=sys.stderr)
        raise SystemExit(2) from None
    print(aot.format_reports(reports, chip, topology, len(devices), info), flush=True)
    w = bound.workload(run, info, len({d.process_index for d in devices}), response_tokens=_RESPONSE.value,
                       observation_share=_OBSERVED.value, prompt_tokens=_PROMPT.value,
                       template_tokens=_TEMPLATE.value)
    parts = bound.step_bound({p.name: p for p in reports}, chip, w)
    print(bound.format_bound(parts, w), flush=True)
    err = aot.check_fit(reports, chip, _HEADROOM.value)
    if err:
        print(err, file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    configlib.app_run(main)
