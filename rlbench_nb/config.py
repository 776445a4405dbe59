"""Typed run configuration: every default lives here, with a one-line description.

    cfg = Config.load("configs/arith_grpo.yaml", overrides=["algo.kl_coef=0.01"])
    print(cfg)                 # the resolved YAML
    cfg.save(run_dir / "config.yaml")

Bad input (unknown key, wrong type, out-of-range value) raises `ConfigError` with one line that names
the dotted key, the bad value and, for typos, the nearest valid key.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config_yaml import UniqueKeyLoader, Yaml12Bools
from .errors import RLBenchError


class ConfigError(RLBenchError, ValueError):
    """A configuration problem, explained in one line."""


def load_object(spec: str, field: str):
    """What a config field names as 'module:name' or 'path/to/file.py:name' (a reward function, an
    environment class); a ConfigError naming the field when it cannot be loaded."""
    import importlib
    import importlib.util
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.exists():
                raise FileNotFoundError(f"file {path} does not exist")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        return getattr(module, name)
    except (ImportError, AttributeError, FileNotFoundError) as e:
        raise ConfigError(f"{field}='{spec}' could not be loaded: {e}") from None


class _Section(BaseModel):
    # allow_inf_nan=False: an infinite learning rate or a NaN coefficient is a typo, never a setting
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


class RunConfig(_Section):
    name: str = "run"
    """Run name; the run directory is <dir>/<name> (a suffix is added if it exists)."""
    dir: str = "runs"
    """Parent folder of run directories."""
    seed: int = 0
    """Seed for data order, sampling and model init."""
    steps: int = Field(400, ge=0)
    """Training steps for `Session.run()` / `rlbench-nb train`."""
    save_rollouts_every: int = Field(10, ge=0)
    """Write rollouts/step_N.jsonl every K steps (0: never)."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a checkpoint every K steps during run() (0: only at the end)."""
    eval_every: int = Field(0, ge=0)
    """Held-out greedy accuracy every K steps during run() (0: before and after only)."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    trackers: list[Literal["wandb", "mlflow"]] = []
    """Also log to these (metrics each step, the config, rollout samples every run.save_rollouts_every steps):
    wandb (offline unless WANDB_MODE says otherwise, files in RUN_DIR/wandb), mlflow (MLFLOW_TRACKING_URI, else a
    file store in RUN_DIR/mlruns). Optional installs: pip install 'rlbench-nb[wandb]' / '[mlflow]'."""
    tracker_project: str = "rlbench-nb"
    """W&B project / MLflow experiment the run is logged under (its run name is run.name)."""
    tracker_samples: int = Field(16, ge=0)
    """Rollout samples in each tracker table."""
    deterministic: bool = False
    """Bit-identical weights for the same seed, config and rank layout: fixed thread counts (cluster.num_threads,
    or 1), deterministic torch algorithms, sampling seeded per draw (determinism.py; docs/determinism.md)."""

    @field_validator("trackers")
    @classmethod
    def _trackers_installed(cls, names: list[str]) -> list[str]:
        import importlib.util
        for n in names:
            if importlib.util.find_spec(n) is None:
                raise ValueError(f"{n} is not installed: pip install 'rlbench-nb[{n}]' (or drop it from run.trackers)")
        return list(dict.fromkeys(names))

    @field_validator("name")
    @classmethod
    def _plain_name(cls, n: str) -> str:
        if not n or n in (".", "..") or n.startswith(".") or "/" in n or "\\" in n:
            raise ValueError("a plain folder name is needed (no path separators, not empty, not starting with "
                             "'.'): the run directory is run.dir/run.name")
        return n


ROLES = ("policy", "rollout", "reward", "reward_model", "reference", "critic")


class PoolConfig(_Section):
    """A resource pool: what each worker of the roles mapped to it reserves, and where it may run."""

    cpus_per_worker: float | None = Field(None, gt=0)
    """CPUs reserved per worker (null: cluster.cpus_per_worker)."""
    gpus_per_worker: float | None = Field(None, ge=0)
    """GPUs reserved per worker (null: cluster.gpus_per_worker)."""
    resources: dict[str, float] = {}
    """Custom Ray resources per worker, e.g. {node_a: 0.01} for a node started with
    `ray start --resources='{"node_a": 1}'`: pins the pool to the nodes that have them."""
    labels: dict[str, str] = {}
    """Node labels its workers' nodes must carry (`ray start --labels=zone=a`)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where its models compute: 'auto' (CUDA when the worker sees a GPU), 'cuda', or 'cpu' (e.g. a reference
    model on CPU while the rest is on GPUs)."""

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for key, amount in resources.items():
            if key in ("CPU", "GPU"):
                raise ValueError(f"give {key} as cpus_per_worker / gpus_per_worker, not in resources")
            if amount <= 0:
                raise ValueError(f"resource {key!r} needs an amount > 0, got {amount}")
        return resources


class ClusterConfig(_Section):
    backend: Literal["local", "ray"] = "local"
    """'local': every role in this process (world size 1, pdb works); 'ray': each rank a Ray actor."""
    address: str | None = None
    """Ray cluster to attach to ('auto', 'HOST:PORT'); null: $RAY_ADDRESS if set, else an embedded one."""
    namespace: str = "rlbench-nb"
    """Ray namespace of the named role actors."""
    num_cpus: int = Field(0, ge=0)
    """Embedded Ray: CPUs it may use (0: all of this machine's)."""
    dashboard: bool = False
    """Embedded Ray: start the dashboard (needed by `ray job submit`; no authentication)."""
    log_to_driver: bool = True
    """Show the workers' stdout/stderr in this process."""
    train_ranks: int = Field(1, ge=1)
    """Ray: FSDP2 ranks of each trainer role (policy, reference, critic)."""
    rollout_ranks: int = Field(1, ge=1)
    """Ray: rollout workers; each generates its share of the batch."""
    cpus_per_worker: float = Field(0.25, gt=0)
    """Ray: CPUs reserved per worker (fractions share cores)."""
    gpus_per_worker: float = Field(0.0, ge=0)
    """Ray: GPUs reserved per worker (fractions colocate roles)."""
    call_timeout_s: float = Field(600.0, gt=0)
    """Ray: a worker call with no answer by then fails, naming the role and rank."""
    channels: bool = True
    """Ray: calls to workers on this machine over a Unix socket (~0.1 ms) instead of Ray tasks (~1-2 ms)."""
    placement_timeout_s: float = Field(60.0, gt=0)
    """Ray: how long to wait for resources before saying what is missing."""
    detached: bool = False
    """Ray: actors outlive this process (needs a cluster started with `ray start --head`)."""
    num_threads: int = Field(0, ge=0)
    """torch CPU threads per process (0: torch's default; 1 under run.deterministic)."""
    pools: dict[str, PoolConfig] = {}
    """Ray: named resource pools (cluster/pools.py), e.g. {actor: {gpus_per_worker: 1}, cpu: {device: cpu}};
    empty: every role reserves cluster.cpus_per_worker / gpus_per_worker anywhere."""
    role_pools: dict[str, str] = {}
    """Ray, with cluster.pools: the pool of each role the run uses (policy, rollout, reward, reward_model,
    reference, critic), e.g. {policy: actor, rollout: actor, reference: cpu}."""

    @model_validator(mode="after")
    def _pools_named(self):
        for role, pool in self.role_pools.items():
            if role not in ROLES:
                near = difflib.get_close_matches(role, ROLES, n=1)
                hint = f" (did you mean '{near[0]}'?)" if near else ""
                raise ValueError(f"cluster.role_pools names an unknown role '{role}'{hint}; roles: {', '.join(ROLES)}")
            if pool not in self.pools:
                raise ValueError(f"cluster.role_pools.{role} names pool '{pool}', which cluster.pools does not "
                                 f"define (pools: {', '.join(self.pools) or 'none'})")
        if self.pools and not self.role_pools:
            raise ValueError("cluster.pools is set but cluster.role_pools maps no role to a pool: add e.g. "
                             f"role_pools: {{policy: {next(iter(self.pools))}}}")
        for name, pool in self.pools.items():
            gpus = self.gpus_per_worker if pool.gpus_per_worker is None else pool.gpus_per_worker
            if pool.device == "cuda" and not gpus:
                raise ValueError(f"cluster.pools.{name} has device 'cuda' but reserves no GPU: set its "
                                 "gpus_per_worker (or device: auto / cpu)")
        return self


class TaskConfig(_Section):
    name: Literal["arithmetic", "tool_arith"] = "arithmetic"
    """Built-in offline task: prompts, verifier, warm-start model. tool_arith: the same prompts (bigger operands in
    configs/arith_tool_grpo.yaml), a model warm-started on episodes that may call a calculator (env.fn:
    rlbench_nb.data.tasks.tool_arith:CalculatorEnv)."""
    max_operand: int = Field(49, ge=1, le=9999)
    """Operands are drawn from [0, max_operand]."""
    ops: str = Field("+", min_length=1)
    """Operators to draw from, any of '+-*'."""
    num_train: int = Field(2000, ge=1)
    """Training prompts in the built-in split."""
    num_test: int = Field(500, ge=1)
    """Held-out prompts (never trained on, by SFT or RL)."""
    warm_start_steps: int = Field(600, ge=0)
    """Most supervised steps of the built-in warm start (cached); it stops at task.warm_start_target."""
    warm_start_target: float = Field(0.4, gt=0, le=1)
    """The warm start stops once its greedy accuracy on 256 training prompts reaches this (checked every 10 steps):
    RL starts from the same skill on any CPU, whatever path the supervised run took to it."""
    warm_start_lr: float = Field(3e-3, gt=0)
    """Learning rate of the warm start (decays linearly to 0 over task.warm_start_steps)."""
    warm_start_batch: int = Field(64, ge=1)
    """Batch size of the warm start."""
    tool_share: float = Field(0.3, ge=0, le=1)
    """tool_arith: share of the warm start's examples that call the calculator (the rest answer directly). Its
    stopping rule (task.warm_start_target) measures the calls: given an opened call, the call and answer right."""

    @model_validator(mode="after")
    def _ops_known(self):
        bad = sorted(set(self.ops) - set("+-*"))
        if bad:
            raise ValueError(f"unknown operator(s) {bad}; use any of '+-*'")
        return self


class LoraConfig(_Section):
    r: int = Field(0, ge=0)
    """Adapter rank; 0: no adapters, the whole model trains. >0: only LoRA adapters train (peft), the reference
    is the same model with its adapters off, checkpoints hold the adapter (docs/lora.md)."""
    alpha: float = Field(32.0, gt=0)
    """Adapter scale numerator: the update is (alpha / r) * B @ A."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt (e.g. [q_proj, v_proj]), or every linear layer but the output head."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (the trainer's log-probs then differ from the engine's)."""

    @model_validator(mode="after")
    def _peft_installed(self):
        import importlib.util
        if self.r and importlib.util.find_spec("peft") is None:
            raise ValueError("LoRA needs the peft package: pip install 'rlbench-nb[lora]' (or set model.lora.r=0)")
        return self


class ModelConfig(_Section):
    path: str | None = None
    """Local Hugging Face model directory, or a GGUF file (or a folder holding one: converted once to a cached
    from_pretrained folder, data/models.py); null: the task's warm-started model."""
    hidden_size: int = Field(128, ge=8)
    """Built-in model: hidden size."""
    num_layers: int = Field(4, ge=1)
    """Built-in model: decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Built-in model: attention heads."""
    intermediate_size: int = Field(256, ge=8)
    """Built-in model: MLP width."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype. Trainers keep fp32 master weights and compute in it (FSDP2 mixed precision when sharded,
    autocast otherwise); rollout and reference hold their weights in it."""
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] = "auto"
    """Attention kernel of the transformers models the roles load (vLLM has its own). auto: transformers' choice,
    except that on a CPU, where it chose SDPA, calls of at most 2^20 scores run as plain matmul-softmax-matmul
    (the same math, without SDPA's fixed cost per call: ops/attention.py)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters: model.lora.r > 0 trains adapters only (model.lora.r=16 model.lora.alpha=32)."""


class DataConfig(_Section):
    train_path: str | None = None
    """JSONL or Parquet file of training prompts; null: the task's split."""
    test_path: str | None = None
    """JSONL or Parquet file of held-out prompts; null: the task's split."""
    test_size: int | None = Field(None, ge=1)
    """Evaluate on the first N held-out rows only (null: all of them): a greedy pass over 1,319 GSM8K questions
    takes hours on a CPU."""
    prompt_key: str = "prompt"
    """Row field holding the prompt text; other fields reach the reward function."""
    max_prompt_len: int = Field(32, ge=1)
    """Rows whose prompt has more tokens are skipped and reported."""
    batch_size: int = Field(32, ge=1)
    """Prompts per training step (each sampled rollout.n times)."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded)."""
    chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template when it has one."""
    system_prompt: str | None = None
    """A system message before every prompt (with the chat template; without one, its text and a blank line
    before the prompt). null: the template's own default, if it has one."""


class RolloutConfig(_Section):
    engine: Literal["hf", "vllm"] = "hf"
    """'hf': transformers with our KV-cache decode loop; 'vllm': a vllm.LLM per rollout worker (rlbench-nb[vllm])."""
    n: int = Field(8, ge=1)
    """Samples per prompt (the group size of GRPO/RLOO)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. Below 1 (or top_k > 0) the samples come from a cut softmax, while the loss scores
    the whole one (as TRL and verl): the HF engine records the whole softmax's log-probs, vLLM the cut's."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0: off)."""
    max_new_tokens: int = Field(8, ge=1)
    """Response length cap; generation also stops at EOS."""
    micro_batch_size: int = Field(512, ge=1)
    """HF engine: sequences per generate() call."""
    dtype: Literal["auto", "model", "float32", "bfloat16"] = "auto"
    """The engine's weights and sampling. auto: bfloat16 for a float32 model on a CPU with native bf16 (AVX512-BF16
    or AMX: 1.5x the decode), else model.dtype (ops/precision.py). The trainers score in model.dtype either way."""
    colocate: bool = False
    """Rollout shares the trainers' devices and, under Ray, the policy's processes (weights handed over in memory;
    cluster.rollout_ranks = train_ranks); it sleeps during updates (vLLM sleep mode / HF weights to host memory; a
    no-op on CPU)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM: GPUs per rollout engine."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM on GPU: share of GPU memory for weights + KV cache (leave room for the trainers when colocated)."""
    kv_cache_gb: int = Field(1, ge=1)
    """vLLM on CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool | None = None
    """vLLM: no CUDA graphs / compilation (null: eager on CPU, graphs on GPU)."""

    def greedy(self, max_new_tokens: int | None = None) -> RolloutConfig:
        """For an evaluation: one greedy response per prompt, capped at `max_new_tokens` (default: this config's)."""
        return self.model_copy(update={"temperature": 0.0, "n": 1,
                                       "max_new_tokens": max_new_tokens or self.max_new_tokens})

    @property
    def truncates(self) -> bool:
        """Sampling cuts the softmax's tail (top-k or top-p): the drawn distribution is not the trainer's."""
        return self.temperature > 0 and (self.top_p < 1 or 0 < self.top_k)


class AlgoConfig(_Section):
    advantage: str = "grpo"
    """Advantage estimator: grpo (Shao et al. 2024), gae (Schulman et al. 2016; needs the critic), rloo (Ahmadian et
    al. 2024), reinforce_pp (Hu 2025), or the name of one registered with `@sess.advantage`."""
    policy_loss: str = "ppo"
    """Per-token policy loss: ppo (the clipped surrogate, with clip_low/clip_high/dual_clip), or the name of one
    registered with `@sess.policy_loss`."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std; false is Dr. GRPO (Liu et al. 2025)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE / REINFORCE++ discount."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    @field_validator("advantage", "policy_loss")
    @classmethod
    def _registered(cls, name: str, info) -> str:
        """A built-in's name, or one registered with @sess.advantage / @sess.policy_loss."""
        from .algos.advantages import ADVANTAGES
        from .algos.losses import POLICY_LOSSES
        registry, what = {"advantage": (ADVANTAGES, "estimator"),
                          "policy_loss": (POLICY_LOSSES, "policy loss")}[info.field_name]
        if name not in registry:
            raise ValueError(f"unknown {what}; known: {sorted(registry)} (register yours with "
                             f"@sess.{info.field_name} before naming it)")
        return name

    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO ratio clip below 1 (epsilon_low)."""
    clip_high: float = Field(0.2, ge=0)
    """PPO ratio clip above 1 (epsilon_high; >clip_low is DAPO clip-higher)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c>1 for negative advantages (Ye et al. 2020); null: off."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses become one number (token-mean is DAPO's)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL(policy || reference) coefficient; 0 skips the reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman 2020): k1 log-ratio, k2 squared, k3 low-variance."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Apply KL as a loss term (GRPO) or as a per-token reward penalty (PPO/RLHF)."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive toward target_kl (Ziegler et al. 2019)."""
    target_kl: float = Field(0.1, gt=0)
    """Adaptive KL controller target."""
    kl_horizon: int = Field(10000, ge=1)
    """Adaptive KL controller horizon."""
    rollout_is: Literal["off", "tis", "mis"] = "off"
    """Correction for sampling with the rollout engine's probabilities q instead of the trainer's p (vLLM,
    bf16, staleness): tis weights each token's loss by min(p/q, rollout_is_cap) (truncated IS); mis drops
    sequences whose ratio prod p/q leaves [1/cap, cap] (masked IS); off. Needs the trainer's old log-probs
    (turns algo.reuse_logprobs off)."""
    rollout_is_cap: float = Field(2.0, gt=1)
    """The cap C of algo.rollout_is."""
    mismatch_alarm: float | None = Field(0.05, gt=0)
    """Warn (and set mismatch/alarm=1) when the mean |log p_trainer - log q_engine| of a step's tokens is above
    this; null: never. An exact engine (HF on CPU in fp32) stays below 1e-5."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    value_clip: float = Field(0.5, gt=0)
    """Clipped value loss range (PPO)."""
    reuse_logprobs: bool = True
    """Where it is exact — one epoch of one mini-batch (train.epochs, train.mini_batches), no algo.rollout_is, the
    KL (if any) as a loss — the old log-probs are the update's own forward (ratio exactly 1, as TRL does with
    num_iterations=1) instead of a separate forward in prepare(), which then has none; the mismatch and kl/ref
    are measured by that forward. Elsewhere prepare() runs the forward whatever this says. false: always."""


class TrainConfig(_Section):
    lr: float = Field(1e-4, ge=0)
    """Policy learning rate (AdamW); 0 steps without moving a weight (what `sess.doctor()` checks)."""
    critic_lr: float = Field(1e-3, ge=0)
    """Critic learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    epochs: int = Field(1, ge=1)
    """Passes over each batch (PPO epochs)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch: the batch is split into this many mini-batches."""
    micro_batch_size: int = Field(256, ge=1)
    """Sequences per forward/backward (gradient accumulation)."""
    critic_warmup: int = Field(0, ge=0)
    """Steps that train only the critic (PPO)."""
    max_skipped_steps: int = Field(5, ge=1)
    """Consecutive steps whose whole update was skipped for a non-finite loss or gradient before the run errors."""
    logprob_chunk_mb: float = Field(256, ge=0)
    """Memory (MiB of fp32 logits) per chunk of the fused log-prob/entropy op: full [B, T, V] logits never exist (0:
    the model's own forward, full logits)."""
    activation_checkpointing: bool = False
    """Recompute decoder activations in the backward pass (less memory, ~1/3 more compute)."""
    share_prompt_prefix: bool = True
    """Run each distinct prompt through the decoder once and reuse its KV cache for its rollout.n responses (log-
    probs and update). Same numbers; used when the role is not sharded and activations are kept, and not with
    train.pack_sequences."""
    pack_sequences: bool | Literal["auto"] = "auto"
    """Padding-free forwards for log-probs, values and the update: each sequence's real tokens end to end in rows
    twice as wide as the longest one, attending only within a sequence (roles/packing.py). Same numbers as padded.
    auto: packed when padding is over a quarter of a micro-batch's positions (1.5x faster at 20M with 44%
    padding; slower than the shared prompt prefix on short, even sequences: benchmarks/packing.py)."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """A token budget per forward/backward instead of train.micro_batch_size rows: real tokens when packing
    (true or auto), rows x padded length when not (0: by rows)."""


class RewardModelConfig(_Section):
    path: str | None = None
    """A local Hugging Face sequence-classification model (num_labels=1: one score per sequence), served by
    the reward_model role and scored beside the rule function; 'task': the built-in task's own, trained on the
    verifier's labels of the warm start's samples (built and cached on first use); None: rule rewards only."""
    weight: float = 1.0
    """The model's score in the reward: scores = reward.rule_weight * rule + reward.model.weight * model."""
    ranks: int = Field(1, ge=1)
    """reward_model ranks under Ray (FSDP2 shards the model across them when >1); one under local."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward pass."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Its weights and compute."""
    max_len: int = Field(1024, ge=8)
    """Tokens it reads per sample, in its own tokenizer; longer texts keep their end (the response)."""
    chat_template: bool | Literal["auto"] = "auto"
    """true: feed (prompt, response) as a user/assistant chat through its tokenizer's own template; false: as
    prompt + response text; 'auto': the chat when its tokenizer has a template. The policy's tokens are decoded
    and re-encoded for it."""


class RewardConfig(_Section):
    fn: str = "task"
    """'task': the task's verifier; or 'module:function' / 'path/file.py:function'."""
    rule_weight: float = 1.0
    """The rule function's score in the reward (with a reward model; alone it is the reward). 0: the rule is
    still run and recorded (reward/rule) but not trained on."""
    model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """A learned reward model beside the rule function."""
    timeout_s: float = Field(30.0, gt=0)
    """Deadline for a batch's reward calls, which run at once: a call still running then scores 0 with a
    timeout error (killed under reward.isolation=process) and the step goes on."""
    isolation: Literal["auto", "thread", "process"] = "auto"
    """Where reward calls run. 'process': worker processes, so sys.exit, os._exit, crashes, runaway memory and
    hangs cost only their samples; 'thread': this process (cheaper; a hung thread cannot be killed); 'auto':
    process for your own functions under the local backend, else thread."""
    processes: int = Field(2, ge=1)
    """reward.isolation=process: worker processes per reward worker."""
    concurrency: int = Field(8, ge=1)
    """Reward calls running at once per process (threads; all of a batch's calls for an async function)."""
    max_memory_gb: float | None = Field(None, gt=0)
    """reward.isolation=process: memory a worker process may take (address space); a call past it fails."""


class EnvConfig(_Section):
    fn: str | None = None
    """A multi-turn environment (rlbench_nb/envs: an Env subclass), 'module:Class' or 'path/file.py:Class': each
    rollout is an episode in which the model and the environment take turns, and the episode's reward is the
    environment's (reward.fn is not called). null: one response per prompt. In a notebook: sess.set_env(MyEnv)."""
    max_turns: int | None = Field(None, ge=1)
    """The model's turns per episode (null: the class's max_turns)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """An environment step still running then ends its episode with an error (the batch goes on)."""


_SECTIONS = {
    "run": RunConfig, "cluster": ClusterConfig, "task": TaskConfig, "model": ModelConfig, "data": DataConfig,
    "rollout": RolloutConfig, "algo": AlgoConfig, "train": TrainConfig, "reward": RewardConfig, "env": EnvConfig,
}


class Config(_Section):
    """The whole run. Sections mirror the package: run, cluster, task, model, data, rollout, algo, train, reward."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Run directory, seed, cadence."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Where the role workers run."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """Built-in offline task."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt datasets."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """RL algorithm."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward function."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Multi-turn environment (episodes instead of single responses)."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.task.name == "tool_arith" and self.env.fn is None and self.data.train_path is None:
            raise ValueError("task.name=tool_arith is a tool task: its episodes need an environment; set "
                             "env.fn=rlbench_nb.data.tasks.tool_arith:CalculatorEnv (or your own)")
        if self.env.fn is not None and self.algo.advantage not in ("grpo", "rloo"):
            raise ValueError(f"env.fn with algo.advantage={self.algo.advantage}: per-token returns across "
                             "environment tokens are not supported yet; use grpo or rloo")
        if self.env.fn is not None and self.run.deterministic:
            raise ValueError("env.fn with run.deterministic: episodes are not seeded per draw yet; set "
                             "run.deterministic=false")
        if self.rollout.engine == "vllm" and self.rollout.truncates and (
                self.algo.rollout_is != "off" or self.algo.mismatch_alarm is not None):
            raise ValueError(
                f"rollout.engine=vllm with rollout.top_p={self.rollout.top_p} / top_k={self.rollout.top_k}: vLLM "
                "returns each token's log-prob after the cut, renormalised over the tokens kept, and the trainer's "
                "differs from it on every token by the kept mass, so the mismatch monitor (algo.mismatch_alarm) and "
                "algo.rollout_is would measure the cut, not the engine. Set rollout.top_p=1 and rollout.top_k=0 "
                "(RL's usual sampling), use rollout.engine=hf (it records the trainer's log-probs), or turn both "
                "off (algo.mismatch_alarm=null, algo.rollout_is=off)")
        if self.algo.advantage in ("grpo", "rloo") and self.rollout.n < 2:
            raise ValueError(f"algo.advantage={self.algo.advantage} compares samples of one prompt: "
                             "set rollout.n to 2 or more")
        samples, ranks = self.data.batch_size * self.rollout.n, self.cluster.train_ranks
        if self.cluster.backend == "ray" and samples % (ranks * self.train.mini_batches):
            # FSDP2 ranks run collectives in lockstep: each needs the same number of (micro-)batches
            raise ValueError(f"data.batch_size x rollout.n = {samples} samples must divide evenly into "
                             f"cluster.train_ranks x train.mini_batches = {ranks * self.train.mini_batches}")
        pools = self.cluster.role_pools
        if self.cluster.backend == "ray" and self.cluster.pools:
            missing = [r for r in self.roles if r not in pools]
            if missing:
                raise ValueError(f"role(s) {', '.join(missing)} have no pool: add them to cluster.role_pools "
                                 f"(pools: {', '.join(self.cluster.pools)})")
            if self.rollout.colocate and pools["rollout"] != pools["policy"]:
                raise ValueError(f"rollout.colocate runs the rollout engine in the policy's processes, so both "
                                 f"need one pool: cluster.role_pools has policy in '{pools['policy']}' and rollout "
                                 f"in '{pools['rollout']}'")
        if self.cluster.backend == "ray" and self.rollout.colocate and self.cluster.rollout_ranks != ranks:
            raise ValueError(f"rollout.colocate runs one rollout engine in each policy process: set "
                             f"cluster.rollout_ranks={ranks} (= cluster.train_ranks), not {self.cluster.rollout_ranks}")
        return self

    @property
    def uses_critic(self) -> bool:
        from .algos.advantages import NEEDS_VALUES
        return self.algo.advantage in NEEDS_VALUES

    @property
    def uses_reference(self) -> bool:
        return self.algo.kl_coef > 0

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles this run starts, in build order (a host role before the roles living in its processes):
        policy, rollout, reward, then the reward model, reference (KL; with LoRA the policy's own model) and
        critic (GAE) when used."""
        extra = (("reward_model",) * bool(self.reward.model.path)
                 + ("reference",) * (self.uses_reference and not self.model.lora.r)
                 + ("critic",) * self.uses_critic)
        return ("policy", "rollout", "reward") + extra

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        data = _deep_copy(data or {})
        for item in [overrides] if isinstance(overrides, str) else overrides:  # one 'key=value' given alone
            _apply_override(data, item)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_one_line(e, data)) from None

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        data: dict = {}
        if path is not None:
            path = _find(Path(path))
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason}): save it "
                                  "as UTF-8") from None
            if not text.strip():
                raise ConfigError(f"config file {path} is empty: give the sections you change (an empty "
                                  "file is more likely a failed copy than a wish for every default)")
            try:
                data = yaml.load(text, Loader=UniqueKeyLoader) or {}
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f" (line {mark.line + 1})" if mark is not None else ""
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                raise ConfigError(f"config file {path} is not valid YAML: {problem}{where}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
        return cls.from_dict(data, overrides)

    @classmethod
    def of(cls, cfg: Config | str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        """A Config as a Session takes it: a Config (`overrides` applied), or a YAML path (None: defaults)."""
        if isinstance(cfg, Config):
            return cls.from_dict(cfg.to_dict(), overrides) if overrides else cfg
        return cls.load(cfg, overrides)

    def override(self, *overrides: str) -> Config:
        """A new Config with dotted `key=value` overrides applied."""
        return Config.from_dict(self.to_dict(), overrides)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    __str__ = to_yaml

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    def _repr_html_(self) -> str:
        from html import escape
        return f"<pre style='font-size:12px'>{escape(self.to_yaml())}</pre>"


# ---- helpers ----------------------------------------------------------------------------------
def _subsection(field) -> type[_Section] | None:
    """The section class a field holds (model.lora), or None for a plain value."""
    t = field.annotation
    return t if isinstance(t, type) and issubclass(t, _Section) else None


def _mapping(field) -> tuple[bool, type[_Section] | None] | None:
    """(True, the section class its values hold, or None for plain values) for a mapping field
    (cluster.pools, cluster.role_pools); None for any other field."""
    import typing
    if typing.get_origin(field.annotation) is not dict:
        return None
    value = typing.get_args(field.annotation)[1]
    return True, value if isinstance(value, type) and issubclass(value, _Section) else None


def _leaves(section: type[_Section], prefix: str):
    """(dotted key, field) of every plain value in `section`, nested sections walked."""
    for k, f in section.model_fields.items():
        sub = _subsection(f)
        yield from (_leaves(sub, f"{prefix}.{k}") if sub else [(f"{prefix}.{k}", f)])


def all_keys() -> list[str]:
    """Every dotted key, e.g. 'algo.kl_coef', 'model.lora.r'."""
    return [key for s, sec in _SECTIONS.items() for key, _ in _leaves(sec, s)]


def help_text() -> str:
    """One line per field: key, default, description. The CLI's --help prints this."""
    lines = []
    for s, sec in _SECTIONS.items():
        lines.append(f"{s}:  {Config.model_fields[s].description}")
        for key, f in _leaves(sec, s):
            default = f.default_factory() if f.default_factory else f.default
            lines.append(f"  {key:<28} = {default!r:<14} {' '.join((f.description or '').split())}")
    return "\n".join(lines)


def _find(path: Path) -> Path:
    """`path`, or for a relative path not found here, the same path under a parent folder: a notebook
    in notebooks/ can say "configs/arith_grpo.yaml" like a script at the repository root."""
    if path.exists() or path.is_absolute():
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        return path
    for parent in list(Path.cwd().parents)[:3]:
        if (parent / path).exists():
            return parent / path
    raise ConfigError(f"config file not found: {path} (looked in {Path.cwd()} and its parents)")


def _deep_copy(d):
    return yaml.safe_load(yaml.safe_dump(d))


def _nearest(key: str) -> str:
    parent, match = _section_at(key.split(".")[:-1]), []
    if parent is not None:  # a typo in the leaf of a known section (also under cluster.pools.<pool>)
        m = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(parent.model_fields), n=1, cutoff=0.6)
        match = [f"{key.rsplit('.', 1)[0]}.{m[0]}"] if m else []
    if not match:
        match = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    if not match:  # a typo in the leaf alone: compare leaves
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in all_keys()}
        m = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
        match = [leaves[m[0]]] if m else []
    return f" (did you mean '{match[0]}'?)" if match else ""


def _section_at(parts: list[str]) -> type[_Section] | None:
    """The section class at a dotted path (through names of the user's in mapping fields), or None."""
    section, named = _SECTIONS.get(parts[0]) if parts else None, None
    for p in parts[1:]:
        if named is not None:
            section, named = named[1], None
        elif section is None or p not in section.model_fields:
            return None
        else:
            field = section.model_fields[p]
            section, named = _subsection(field), _mapping(field)
    return section if named is None else None


def _apply_override(data: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key=value, e.g. algo.kl_coef=0.01")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    section = _SECTIONS.get(parts[0])
    if len(parts) < 2 or section is None:
        raise ConfigError(f"unknown config key '{key}'{_nearest(key)}")
    value = yaml.load(raw, Loader=Yaml12Bools) if raw.strip() else None
    cur, where, named = data, parts[0], None
    for i, p in enumerate(parts[1:], start=1):  # down the nested sections (model.lora.r) to the leaf's mapping
        cur = cur.setdefault(parts[i - 1], {})
        if not isinstance(cur, dict):
            raise ConfigError(f"config section '{where}' must be a mapping, got {cur!r}")
        if named is not None:  # a name of the user's in a mapping field (cluster.pools.<pool>): any key goes
            section, named = named[1], None
        elif section is None or p not in section.model_fields:
            raise ConfigError(f"unknown config key '{key}'{_nearest(key)}")
        else:
            field = section.model_fields[p]
            section, named = _subsection(field), _mapping(field)
        where = f"{where}.{p}"
    if section is not None and not isinstance(value, dict | None):
        first = next(iter(section.model_fields))
        raise ConfigError(f"'{key}' is a section: set one of its keys (e.g. {key}.{first}=...)")
    cur[parts[-1]] = value


def _lookup(data: dict, loc: tuple) -> Any:
    cur: Any = data
    for p in loc:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        else:
            return "<missing>"
    return cur


def _one_line(err: ValidationError, data: dict) -> str:
    first = err.errors()[0]
    loc = tuple(p for p in first["loc"] if isinstance(p, str))
    key = ".".join(loc) if loc else "<config>"
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{key}'{_nearest(key)}"
    msg = first["msg"].removeprefix("Value error, ")
    if not loc:
        return f"invalid config: {msg}"
    value = _lookup(data, loc)
    more = f" (and {len(err.errors()) - 1} more problem(s))" if len(err.errors()) > 1 else ""
    # a section's own check: its message names the keys, and the whole mapping would be noise
    if isinstance(value, dict) and _section_at(list(loc)) is not None:
        return f"invalid '{key}' section: {msg}{more}"
    return f"invalid value for '{key}': {value!r} — {msg}{more}"
