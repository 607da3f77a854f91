"""Base configuration shared by every run: `get_config(preset)` with presets paper | local | tiny | operators.

Each section is built from the dataclass it configures (`configlib.section`), so every default is
written once, in that dataclass, and every field can be set on the command line:

    python -m workflow_r1.train --config=configs/gsspo.py:local --config.train.learning_rate=3e-6

Presets:
  paper  the paper's run (docs/paper.md, Hyper-parameters): Qwen2.5-7B-Instruct (its HF directory
         as --config.model.checkpoint), 512 questions x 8 rollouts, 4 mini-batches, lr 1e-6, KL 0.001,
         prompt 1280 / response 8192 tokens, 2 epochs over the 10k NQ + HotpotQA mix
         (--config.data.train_files), an executor service in front of Qwen2.5-32B-Instruct
         (--config.executor.url), bf16 compute with fp32 master weights, remat, layers under
         lax.scan, parameters and optimizer state sharded over every chip (FSDP); the faithful prompt
         set; Search answers 5 results as title + 160-character snippet.
  local  the embedded default on a laptop CPU, a learning run (docs/learning.md): the bundled real
         Qwen2.5-Coder-0.5B-Instruct as the policy (LoRA rank 16 over a frozen bf16 base) and,
         in-process, as the executor LLM; the Workflow-R1-Search operator pool with BM25 over the
         bundled corpus; the bundled questions, 32 of them held out; 16 steps of 8
         questions x 4 rollouts with small token budgets, turns ending at their action, groups
         without reward spread skipped, each group's prompt computed once in the update
         (train.share_prompts); greedy evaluation of the held-out questions before and after,
         compared question by question; the `local_search` prompt set, the concise one with a
         worked example that searches (--config.env.prompt_set=faithful with
         --config.rollout.max_prompt_tokens=1280 runs the paper's wording).
  tiny   a tiny random model over a byte-level tokenizer and the fake executor LLM (tests, smoke
         runs); the concise prompt set.
  operators  the loss ablation's synthetic task (`env.kind=operators`, workflow_r1/envs/operators.py)
         on the tiny model: its budgets, 32 questions x 8 samples for 80 steps, an optimiser a tiny
         model learns with in tens of steps (the same for every loss), a greedy evaluation on 512
         questions, checkpoints every 20 steps and no HF export.
Variants follow the preset after commas, e.g. `configs/gsspo.py:local,tight`:
  tight  the GSPO paper's clip range for sequence-level ratios, 3e-4 / 4e-4 (GSPO and GSsPO only;
         the default 0.2 / 0.2 is what the Workflow-R1 release ran, docs/paper.md, Clipping, KL and
         aggregation).
The loss-specific files (gsspo.py, grpo.py, gspo.py) start from this and change only the loss.
"""

import ml_collections

from workflow_r1 import checkpointing, configlib
from workflow_r1.data.config import DataConfig
from workflow_r1.envs import operators
from workflow_r1.task.config import EnvConfig
from workflow_r1.eval import EvalConfig
from workflow_r1.executor.connect import ExecutorConfig
from workflow_r1.policy import ModelConfig
from workflow_r1.rl.train_state import TrainConfig
from workflow_r1.rollout import RolloutConfig
from workflow_r1.run_config import RunConfig
from workflow_r1.sharding import MeshConfig

PRESETS = ("paper", "local", "tiny", "operators")
# The local learning run's length: measured to fit the first command's 45 minutes on 2 cores,
# install included (docs/learning.md).
LOCAL_STEPS = 16
VARIANTS = ("tight",)


def parse_arg(arg: str) -> tuple[str, tuple[str, ...]]:
    """"local,tight" -> ("local", ("tight",)), each checked against PRESETS / VARIANTS."""
    preset, *variants = [a.strip() for a in (arg or "local").split(",")]
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {PRESETS}")
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; use one of {VARIANTS} after the preset, e.g. local,tight")
    return preset, tuple(variants)


def apply_variants(c: ml_collections.ConfigDict, variants: tuple[str, ...]) -> ml_collections.ConfigDict:
    if "tight" in variants:
        if c.train.granularity == "token":
            raise ValueError("variant tight is the GSPO paper's clip range for sequence-level ratios; "
                             "use it with gspo.py or gsspo.py")
        c.train.clip_eps_low, c.train.clip_eps_high = 3e-4, 4e-4
    c.variants = ",".join(variants)
    return c


def get_config(preset: str = "local") -> ml_collections.ConfigDict:
    preset, _ = parse_arg(preset)
    if preset == "operators":
        return _operator_task(get_config("tiny"))
    paper, local, tiny = preset == "paper", preset == "local", preset == "tiny"
    c = ml_collections.ConfigDict()
    c.preset = preset
    c.variants = ""
    for key, value in configlib.section(RunConfig, steps=0 if paper else LOCAL_STEPS if local else 2).items():
        c[key] = value

    c.model = configlib.section(
        ModelConfig, preset={"paper": "qwen2.5-7b", "local": "", "tiny": "tiny-chat"}[preset],
        # Mixed precision (fp32 master weights, bf16 matmuls; docs/design.md, Precision) where the
        # real model trains: ~25% faster updates on the local CPU run than fp32, same memory.
        dtype="bfloat16" if (paper or local) else "float32",
        # The 7B's 28 layers under one scanned body: its update compiles in minutes, not hours
        # (checked before any TPU exists: python -m workflow_r1.aot, docs/replicate.md).
        scan_layers=paper,
        # Rematerialisation keeps a 0.5B update of long trajectories within a laptop's memory.
        remat=paper or local,
        # local: LoRA (rank 16, every projection) over a frozen bf16 base: the update holds the
        # adapters' 8.8M fp32 parameters and AdamW moments instead of all 630M, and a checkpoint
        # holds only them (docs/design.md, LoRA).
        **({"lora_rank": 16, "param_dtype": "bfloat16"} if local else {}))

    # Small budgets where a laptop runs the whole loop; the paper's everywhere else.
    c.rollout = configlib.section(
        RolloutConfig,
        # local: 8 questions x 4 samples, so most steps hold groups whose rewards differ (a learning
        # signal); 384 response tokens hold a search, its 3 passages and an answer (docs/learning.md).
        **({} if paper else {"prompts_per_step": 8, "n": 4} if local else {"prompts_per_step": 4, "n": 2}),
        **({"max_prompt_tokens": 1024, "max_response_tokens": 384, "max_turn_tokens": 128,
            "max_assistant_turns": 3, "sampler_dtype": "bfloat16"} if local else {}),
        # local: every batch is 1,536 long (its prompts and responses fit 1,408): one update shape.
        **({"pad_multiple": 512} if local else {}),
        # bf16 sampler weights where the policy computes in bf16 (the same numbers, half the bytes;
        # local's fused CPU sampler holds bf16 weights already); tiny computes in fp32 and keeps them.
        # paper: each host's sampler is tensor-parallel over all its chips (a v5p host's 4: ~3.5 GiB
        # of the 7B's bf16 weights per chip), apart from the training mesh's FSDP layout.
        **({"weights_dtype": "bfloat16"} if (paper or local) else {}),
        **({"tensor_parallel": -1} if paper else {}),
        **({"max_prompt_tokens": 4096, "max_response_tokens": 1024, "max_turn_tokens": 48,
            "max_assistant_turns": 4} if tiny else {}),
        # paper: a host's rows (2,048 per v5p-16 host, 4,096 on v5p-8) run 256 at a time, each with
        # its whole page budget (37,888 pages, 32.38 GiB per chip split over the KV heads). With the
        # bf16 tensor-parallel sampler and the TPU kernel over the pages, compiled ahead of time
        # (python -m workflow_r1.aot, libtpu 0.0.42): prefill 63% / decode 55% / sync 22% of a v5p-16
        # chip, 78% / 70% / 35% on v5p-8, and half the rollout bound of 32 rows (391 s against 776 s
        # a step on v5p-16). 32, the most that kept a margin when the sampler held fp32 copies and
        # a dense working cache, took 24% / 39% on this layout (docs/replicate.md).
        **({"max_rows_in_flight": 256} if paper else {}),
        # local: ragged engine steps of up to 256 tokens (docs/design.md, the engine). On the 2-core
        # VM, 8 questions x 4 samples at local's budgets: 55 s against 80 s for the calls (1.45x,
        # fewer compiled shapes); the README's 4 rows: 266 s against 279 s for the whole run
        # (benchmarks/README.md). The paper preset stays on calls until a TPU run compares them.
        # local: a turn ends at its action (`</tool>` or `</answer>`): the untrained 0.5B otherwise goes
        # on to write the observation and the next turn itself (docs/learning.md, docs/paper.md).
        **({"max_tokens_per_step": 256, "stop_at_action": True} if local else {}))

    # Paper: fully sharded (FSDP over every chip): replicated, the 7B's fp32 weights, AdamW moments
    # and gradients alone take ~122 GB per device (docs/replicate.md, the AOT table).
    c.mesh = configlib.section(MeshConfig, **({"data": 1, "fsdp": -1} if paper else {}))

    c.train = configlib.section(
        TrainConfig,
        # local: one group a micro-batch, so its prompt runs once for its 4 responses in the update.
        micro_batch_size={"paper": 8, "local": 4, "tiny": None}[preset],
        # On a laptop: one update per step, and no KL term (a frozen copy of the policy would cost
        # another 1.3 GB; the GSPO paper trains without it too). The paper preset keeps 0.001.
        # LoRA adapters take a larger rate than full fine-tuning; a group whose 4 rewards are equal
        # teaches nothing, so it is dropped (dynamic sampling, docs/design.md); the batch keeps its shape,
        # its padding micro-batches skipped, so the update compiles once per response width, not once per
        # kept-row count. Its logits scored in chunks of 128 positions: a micro-batch's 1,536 at once
        # took 0.9 GB and as much again for their gradient (docs/learning.md, Time and memory).
        **({"num_mini_batches": 1, "kl_coef": 0.0, "learning_rate": 5e-5, "filter_groups": True,
            "filter_keep_shape": True, "logprob_chunk_size": 128, "logprob_unchunked_max_mb": 0} if local else {}),
        # local: each group's prompt (about 900 of an episode's 1,000-1,300 tokens) runs once per
        # micro-batch in the update (docs/design.md, Shared-prompt updates); with an earlier, shorter
        # prompt the update ran 2.5x faster on the bundled 0.5B (benchmarks/README.md).
        # Off elsewhere: paper's win is unmeasured (no TPU; compiled ahead of time its bound falls 9%
        # and its memory rises 3.3 GiB a chip, docs/replicate.md); tiny is the tests' preset;
        # operators' prompts are 2 tokens of 18.
        **({"share_prompts": True} if local else {}),
        **({"learning_rate": 1e-3, "num_mini_batches": 1} if tiny else {}))
    # Both sides of the importance ratio score the sampling distribution: one value for both keys.
    c.train.temperature = c.rollout.get_ref("temperature")

    # The faithful prompt (about 1,120 Qwen tokens, 5,300 bytes) fits neither the local prompt budget of
    # 1,024 tokens nor the tiny byte-level one of 4,096: both run the concise set (about 800 tokens).
    # local: the `local_search` set, the concise one with a short user message ending in an example
    # that searches, and a worked episode as chat turns, which the 0.5B follows (docs/learning.md).
    # local: the Workflow-R1-Search pool (Search replaces MultiAnswerGenerate): the untrained 0.5B
    # answers few bundled questions from memory, the bundled corpus holds every answer (docs/learning.md).
    c.env = configlib.section(EnvConfig, **({"max_operator_calls": 2, "variant": "search"} if local else {}),
                              **({} if paper else {"prompt_set": "local_search" if local else "concise"}))
    c.executor = configlib.section(
        ExecutorConfig,
        llm={"paper": "local", "local": "local", "tiny": "fake"}[preset],
        # Paper: 5 results as title + snippet, like the web search it stands in for (docs/paper.md, Search).
        search_topk=5 if paper else 3, search_snippet_chars=160 if paper else 0,
        **({"max_tokens": 64, "max_attempts": 1, "timeout_s": 300.0} if local else {}))
    # local: 32 of the 109 bundled questions held out (a split drawn with `seed`), never trained on.
    c.data = configlib.section(DataConfig, eval_holdout={"paper": 0, "local": 32, "tiny": 4}[preset])
    # local: the untrained policy is evaluated too, so the run shows its evaluation before and after.
    c.eval = configlib.section(EvalConfig, batch_size=32 if local else (8 if tiny else 256), at_start=local)
    # Saved asynchronously, so a killed run resumes. local: after every step, only the newest kept (the
    # adapters, their moments and the data position: about 0.1 GB). paper: every 5 of its 38 steps,
    # the last 2 kept.
    c.checkpoint = configlib.section(checkpointing.CheckpointConfig, async_save=True,
                                     every_steps={"paper": 5, "local": 1, "tiny": 1}[preset],
                                     keep={"paper": 2, "local": 1, "tiny": 3}[preset])
    return c


def _operator_task(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The `tiny` config as the `operators` preset (the synthetic task's budgets are its environment's)."""
    c.preset = "operators"
    c.env.kind = "operators"
    c.steps, c.log_trajectories = 80, 8
    for key, value in {"prompts_per_step": 32, "n": 8, **operators.ROLLOUT}.items():
        c.rollout[key] = value
    # A tiny model learns the task in tens of steps at this rate; no KL term.
    for key, value in {"learning_rate": 3e-3, "weight_decay": 0.0, "num_mini_batches": 2, "micro_batch_size": 32,
                       "logprob_chunk_size": 4, "kl_coef": 0.0}.items():
        c.train[key] = value
    c.eval.max_questions, c.eval.batch_size = 512, 512
    c.checkpoint.every_steps, c.checkpoint.export_hf = 20, False  # no HF export of a 16-token model
    return c
