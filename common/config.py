"""One TOML file configures every role: typed sections, validated once at load, CLI overrides, a resolved copy.

Sections: ``[run]`` (shared by all roles), ``[model]``, ``[broker]``, ``[worker]``, ``[learner]``, ``[eval]``,
``[security]``, ``[launch]`` (read only by ``loraflow run``). Every field documents its unit and range next to its
type; ``loraflow config --reference`` prints the table generated from these declarations. Values are validated
at load by :mod:`loraflow.common.schema` (wrong types, unknown keys and out-of-range values name the offending
``section.key``), then cross-field rules are checked in :func:`validate`.

Overrides: ``--set section.key=value`` with a TOML value (``--set worker.temperature=0.7``,
``--set learner.target_modules=["q_proj","v_proj"]``); a bare word that is not valid TOML is taken as a string.
The resolved config is written into the run directory by :func:`write_resolved` so a run can be reproduced.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow.common import lora_targets
from loraflow.common.schema import SchemaError, build, dump, rule


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and what to change."""


@dataclass(slots=True, kw_only=True)
class RunConfig:
    name: str = rule("demo", max_len=128, doc="run name, used in logs and the default run directory")
    run_dir: str = rule("", doc="where logs, metrics, checkpoints and adapters go; default runs/<name>")
    pool_run: str = rule("", max_len=48, doc="the run this learner or worker joins on a pool broker (a run "
                          "`loraflow submit` added; its id); '' = the broker's own run")
    seed: int = rule(0, ge=0, doc="seed for prompts, sampling and initialisation")
    weight: float = rule(1.0, gt=0, le=1000, doc="a pool run's share of its shared workers' engines: tokens "
                         "generated per unit of weight are kept level between the runs that want to generate")
    group_size: int = rule(8, ge=1, le=1024, doc="samples per prompt (a GRPO group; travels whole)")
    groups_per_step: int = rule(16, ge=1, le=4096, doc="groups in one learner step")
    max_staleness: int = rule(1, ge=0, le=1000,
                              doc="versions a sample may lag the learner; 0 = synchronous on-policy")
    num_steps: int = rule(0, ge=0, doc="learner steps before the run stops; 0 = until stopped")
    max_duration_s: float = rule(0.0, ge=0, unit="s", doc="wall-time limit of `loraflow run`; 0 = none")
    connect_timeout_s: float = rule(120.0, gt=0, le=86_400, unit="s",
                                    doc="how long a worker or the learner waits for the broker's Welcome at start-up "
                                    "(any start order within it works); a failed CURVE handshake ends it at once")
    task: str = rule("arith", max_len=512,
                     doc="built-in task name (arith, calculator), or a dataset: a JSONL, JSON, Parquet or CSV "
                     "file, a save_to_disk directory or a directory of data files (options in [data])")
    log_format: str = rule("console", choices=("console", "json"), doc="console for people, json for machines")
    log_level: str = rule("info", choices=("debug", "info", "warning", "error"))
    report_to: list[str] = rule(default_factory=list, choices=("wandb", "tensorboard"),
                                doc="experiment trackers for the learner's step metrics, held-out evals and the "
                                "config (TRL's names); [] = none; needs pip install 'loraflow[tracking]'")


@dataclass(slots=True, kw_only=True)
class ModelConfig:
    path: str = rule("builtin:tiny", doc="local HF model directory, or builtin:tiny (built offline, cached), or "
                     "builtin:demo (the tiny model warmed up for the demo: built by `loraflow run` or `python -m "
                     "loraflow.deploy.demo_base --seed N`, then found in the cache by every role)")
    cache_dir: str = rule("", doc="where builtin models are built; default ~/.cache/loraflow")
    dtype: str = rule("float32", choices=("float32", "bfloat16", "float16"), doc="weights dtype for generation")
    max_seq_len: int = rule(512, ge=8, le=1 << 20, unit="tokens", doc="prompt + completion limit")
    chat_template_kwargs: dict[str, Any] = rule(default_factory=dict,
                                                 doc="extra arguments of the tokenizer's chat template for "
                                                 "conversational prompts, e.g. {enable_thinking = false}")


@dataclass(slots=True, kw_only=True)
class BrokerConfig:
    endpoint: str = rule("tcp://127.0.0.1:5555", doc="where clients connect")
    bind: str = rule("", doc="where the broker binds (e.g. tcp://0.0.0.0:5555); default = endpoint")
    endpoint_file: str = rule("", doc="the broker writes its bound endpoint here (useful with port 0)")
    capacity_groups: int = rule(0, ge=0, doc="buffered + leased groups allowed; 0 = groups_per_step x (max_staleness + 1) + workers")
    max_buffer_bytes: int = rule(1 << 30, ge=1 << 16, unit="bytes", doc="byte bound of buffered groups")
    lease_timeout_s: float = rule(300.0, gt=0, unit="s", doc="a lease neither returned nor renewed by its worker's heartbeats (which name the leases it is still working on) for this long goes back to the queue")
    heartbeat_interval_s: float = rule(1.0, gt=0, le=60, unit="s")
    heartbeat_misses: int = rule(5, ge=2, le=100, doc="missed heartbeats before a client is declared dead")
    max_heartbeats_per_second: float = rule(2000.0, ge=0, le=1e6, unit="beats/s", doc="heartbeats the broker asks for "
                                       "at most: a fleet larger than this x heartbeat_interval_s is asked to beat "
                                       "more slowly (its death timeout stretches with it); 0 = no limit")
    max_message_bytes: int = rule(256 << 20, ge=1 << 16, unit="bytes", doc="larger messages are refused")
    max_workers: int = rule(4096, ge=1)
    max_observers: int = rule(64, ge=0, doc="observers registered at once (a StatsRequest needs no Hello, so "
                              "`loraflow status` does not count)")
    max_leases_per_worker: int = rule(64, ge=1)
    num_adapters_kept: int = rule(4, ge=1, doc="newest adapter versions the broker keeps for fetches")
    state_path: str = rule("", doc="persisted cursor/version file; default <run_dir>/broker/state.json")
    state_write_interval_ms: float = rule(20.0, ge=0, le=10_000, unit="ms",
                                          doc="background state writes start at least this long after the previous "
                                          "one (group commit; the acks they cover wait for them); 0 = back to back")
    prompt_limit: int = rule(0, ge=0, doc="prompts per epoch for generated tasks (0 = unbounded)")
    num_epochs: int = rule(0, ge=0, doc="stop leasing after this many epochs; 0 = forever")
    metrics_port: int = rule(0, ge=0, le=65535, doc="Prometheus /metrics port; 0 = off")
    pool: bool = rule(False, doc="serve runs submitted while it runs (`loraflow submit`, found under "
                      "<run_dir>/runs/), each with its own ledger and adapter lineage, beside its own run")
    tenant_code: list[str] = rule(default_factory=lambda: ["loraflow"], max_len=64,
                                  doc="packages whose code a run submitted over the network (--connect) may name "
                                  "in worker.reward / rewards / env / agent: that code runs in the pool's workers")
    tenant_data: list[str] = rule(default_factory=list, max_len=64, doc="directories whose datasets a run "
                                  "submitted over the network may name (run.task, data.eval_path); empty = none")


@dataclass(slots=True, kw_only=True)
class SimConfig:
    tokens_per_s: float = rule(2000.0, gt=0, unit="tokens/s", doc="simulated decode speed per sample stream")
    mean_tokens: float = rule(64.0, gt=0, unit="tokens", doc="mean completion length")
    length_sigma: float = rule(1.0, ge=0, doc="lognormal sigma of completion length (0 = fixed length)")
    max_tokens: int = rule(4096, ge=1, unit="tokens")
    vocab_size: int = rule(256, ge=2)


@dataclass(slots=True, kw_only=True)
class VllmConfig:
    max_loras: int = rule(0, ge=0, doc="adapters resident in the engine; 0 = max_staleness + 2")
    kv_cache_gib: float = rule(1.0, gt=0, unit="GiB", doc="CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = rule(0.85, gt=0, le=1)
    max_num_seqs: int = rule(64, ge=1)
    enforce_eager: bool = rule(True)


@dataclass(slots=True, kw_only=True)
class WorkerConfig:
    id: str = rule("", max_len=128, doc="worker id; default <host>-<pid>")
    backend: str = rule("hf", choices=("hf", "vllm", "sim"))
    device: str = rule("auto", doc="auto, cpu, cuda, cuda:N")
    num_threads: int = rule(0, ge=0, doc="torch CPU threads; 0 = torch default")
    capacity: int = rule(1, ge=1, le=1024, doc="leases (groups) generated concurrently")
    temperature: float = rule(1.0, gt=0, le=10)
    top_p: float = rule(1.0, gt=0, le=1)
    max_new_tokens: int = rule(16, ge=1, unit="tokens", doc="per turn")
    chunk_tokens: int = rule(16, ge=1, unit="tokens", doc="decode chunk; adapter swaps happen between chunks")
    partial_policy: str = rule("continue", choices=("finish", "continue", "abort"),
                               doc="what a new adapter does to a generation in progress")
    max_aborts: int = rule(2, ge=0, doc="abort policy: restarts of one sample at most, then it continues under "
                           "the newest adapter (so it finishes even when adapters arrive faster than it takes)")
    finish_within_tokens: int = rule(0, ge=0, le=1 << 20, unit="tokens",
                                     doc="continue and abort policies: a turn with at most this many tokens left "
                                     "of its budget when a new adapter arrives finishes under its version instead "
                                     "of re-reading its prefix under the new one (those tokens one version "
                                     "staler); 0 = never")
    keep_version_within: int = rule(0, ge=0, le=1000, unit="versions",
                                    doc="continue and abort policies: a turn under way keeps the adapter version "
                                    "it runs under while the newest is at most this many versions ahead, instead "
                                    "of re-reading its prefix under each new one (its tokens up to this many "
                                    "versions staler, each generated by exactly the version it records; below "
                                    "run.max_staleness); 0 = moves to every new version")
    env: str = rule("", doc="environment: empty = the run's task, or package.module:Name")
    reward: str = rule("", doc="reward function replacing the environment's score: package.module:function, "
                       "TRL-style (batched) or loraflow's per-sample signature (see loraflow.rollout_worker.rewards)")
    rewards: list[str] = rule(default_factory=list, max_len=64,
                              doc='several TRL-style reward functions, summed with reward_weights (as TRL\'s '
                              'GRPOTrainer); "loraflow:exact_match" and "loraflow:format" are built in')
    reward_weights: list[float] = rule(default_factory=list, max_len=64,
                                       doc="one weight per worker.rewards entry; empty = 1.0 each")
    reward_timeout_s: float = rule(10.0, gt=0, unit="s")
    max_failed_reward_groups: int = rule(8, ge=0, doc="stop the worker (exit 2, not restarted) after this many "
                                         "groups in a row whose every sample's reward or environment failed; "
                                         "0 = never")
    max_turns: int = rule(4, ge=1, doc="multi-turn environments: model turns per episode")
    stop_token_ids: list[int] = rule(default_factory=list, doc="token ids that also end a model turn, besides "
                                     "the tokenizer's eos and every generation_config.eos_token_id")
    stop_strings: list[str] = rule(default_factory=list, doc="strings that end a model turn like an eos (the text "
                                   "handed to rewards stops before them)")
    adapter_dir: str = rule("", doc="where received adapters are written; default <run_dir>/workers/<id>/adapters")
    metrics_port: int = rule(0, ge=0, le=65535)
    agent: str = rule("", doc='agent harness: package.module:run_episode, async (client, row) -> float | dict, '
                      'driving the worker\'s OpenAI-compatible gateway (rollout_worker/gateway); "external" = '
                      'harnesses in other processes claim episodes over HTTP; empty = worker.env')
    agent_timeout_s: float = rule(120.0, gt=0, unit="s", doc="one agent episode at most; past it the episode "
                                  "scores 0 (counted agent_failures{reason=timeout}); any length: the worker's heartbeats "
                                  "renew the lease of a group whose episodes still run")
    gateway_bind: str = rule("127.0.0.1:0", max_len=256, doc="HOST:PORT the gateway listens on (0 = any free "
                             "port; written to <run_dir>/workers/<id>/gateway.json); beyond loopback only "
                             "with security.enabled, which also requires its token")
    gateway_max_request_bytes: int = rule(4 << 20, ge=1024, unit="bytes", doc="larger requests get 413")
    tool_parser: str = rule("hermes", choices=("hermes", "none"),
                            doc="how tool calls are read from the model's text: hermes = <tool_call>{json}</tool_call>")
    tito_divergence: str = rule("count", choices=("count", "refuse"),
                                doc="a call whose template re-renders held tokens differently: count "
                                "(keep the held tokens, count tito_divergence{reason}) or refuse the call")
    sim: SimConfig = field(default_factory=SimConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    pool: bool = rule(False, doc="serve every running run of the pool in run.run_dir with one engine, a thread "
                      "per run (the shared workers of loraflow pool: launch.shared_workers)")
    max_runs: int = rule(8, ge=1, le=256, doc="pool workers: runs served at once (vLLM holds max_runs x "
                         "(run.max_staleness + 2) adapters unless worker.vllm.max_loras says)")


@dataclass(slots=True, kw_only=True)
class LearnerConfig:
    device: str = rule("auto", doc="auto, cpu, cuda")
    num_threads: int = rule(0, ge=0, doc="torch CPU threads per rank; 0 = torch default")
    lr: float = rule(1e-3, gt=0, le=1)
    weight_decay: float = rule(0.0, ge=0)
    grad_clip: float = rule(1.0, ge=0, doc="max grad norm; 0 = off")
    warmup_steps: int = rule(0, ge=0)
    lora_rank: int = rule(16, ge=1, le=1024)
    lora_alpha: float = rule(32.0, gt=0)
    lora_dropout: float = rule(0.0, ge=0, le=0.9)
    target_modules: str | list[str] = rule(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"],
                                           doc='"all-linear" (every linear layer but the output head) or module '
                                           'names matched as peft does (q_proj = every *.q_proj); only linear '
                                           "layers: embeddings and lm_head are refused at start-up")
    clip_eps: float = rule(0.2, gt=0, le=10, doc="PPO clip range (lower)")
    clip_eps_high: float = rule(0.0, ge=0, le=10, doc="PPO clip range (upper); 0 = clip_eps")
    off_policy: str = rule("tis", choices=("none", "tis", "mask"),
                           doc="stale-sample correction: none, truncated IS (token), ratio-band mask")
    tis_cap: float = rule(2.0, gt=0, doc="truncated importance-sampling weight cap")
    mask_low: float = rule(0.5, gt=0, doc="mask: drop tokens whose IS ratio is below this")
    mask_high: float = rule(2.0, gt=0, doc="mask: drop tokens whose IS ratio is above this")
    kl_beta: float = rule(0.0, ge=0, doc="KL penalty to the base model (adapter disabled); 0 = off")
    scale_by_std: bool = rule(True, doc="divide group advantages by the group std")
    micro_batch_tokens: int = rule(8192, ge=16, unit="tokens", doc="token budget of one micro-batch")
    mixed_precision: str = rule("auto", choices=("auto", "fp32", "bf16"),
                                doc="compute dtype, also the frozen base's storage: auto = bf16 on GPUs, fp32 on CPU")
    adapter_dtype: str = rule("auto", choices=("auto", "float32", "bfloat16"),
                              doc="dtype adapters are published in; auto = the compute dtype (bf16 on GPUs)")
    activation_checkpointing: str = rule("auto", choices=("auto", "on", "off"),
                                         doc="recompute each decoder layer in backward; auto = on GPUs only")
    publish_every: int = rule(1, ge=1, unit="steps", doc="publish an adapter version every k steps")
    save_adapter_every: int = rule(10, ge=0, unit="versions", doc="write a PEFT dir every N versions; 0 = only at the end")
    checkpoint_every: int = rule(20, ge=0, unit="steps", doc="DCP checkpoint interval; 0 = off")
    keep_checkpoints: int = rule(2, ge=1)
    batch_wait_ms: int = rule(1000, ge=1, le=600_000, unit="ms", doc="long-poll for one batch request")
    resume: bool = rule(True, doc="continue from the newest complete checkpoint if there is one")
    metrics_port: int = rule(0, ge=0, le=65535)
    adam_eps: float = rule(1e-8, gt=0, le=1, doc="AdamW epsilon: gradient entries far below it barely move")
    pool: bool = rule(False, doc="train every running run of the pool in run.run_dir over one frozen base, a "
                      "thread per run (the shared learner of loraflow pool: launch.shared_learner)")


@dataclass(slots=True, kw_only=True)
class DataConfig:
    """How a dataset task (``run.task`` = a file or directory) is read; see common/dataset.py."""

    prompt_column: str = rule("prompt", max_len=256, doc="column holding the prompt: a string, or a list of "
                              "{role, content} messages (TRL's conversational format)")
    answer_column: str = rule("answer", max_len=256, doc="column holding the reference answer (the built-in "
                              "exact-match score uses it); empty = the dataset has none")
    split: str = rule("train", max_len=256, doc="split trained on (a saved DatasetDict, a directory of data files)")
    eval_split: str = rule("", max_len=256, doc="held-out split of the same dataset (e.g. test)")
    eval_path: str = rule("", max_len=4096, doc="held-out data in another file or directory (its data.split is used)")
    eval_fraction: float = rule(0.1, ge=0, le=0.9, doc="without eval_split/eval_path: this share of the rows, "
                                "taken from the start, is held out (at least one row when there are two)")
    system_prompt: str = rule("", max_len=1 << 16, doc="put before every prompt as a system message (a conversation "
                              "that starts with its own keeps that); string prompts then become one user message")


@dataclass(slots=True, kw_only=True)
class EvalConfig:
    num_prompts: int = rule(200, ge=0, doc="held-out prompts for greedy accuracy; 0 = no evaluation")
    every_s: float = rule(30.0, ge=0, unit="s", doc="measure held-out accuracy this often during a run; 0 = ends only")
    target_accuracy: float = rule(0.8, ge=0, le=1)
    device: str = rule("auto", max_len=128, doc="where loraflow run evaluates: auto = a GPU no process of the run "
                       "holds, else one no vLLM worker uses, else cpu (deploy/devices.py); cpu; or a GPU id "
                       "from CUDA_VISIBLE_DEVICES. bf16 on a GPU")


@dataclass(slots=True, kw_only=True)
class IntegrityConfig:
    """The policy check (common/integrity.py): the learner re-scores what each group claims, the broker
    quarantines a worker whose groups keep failing."""

    check: bool = rule(True, doc="check each group's evidence and re-score its chosen samples under the exact "
                       "version each token claims (every group of a worker on probation, else on audited steps "
                       "and for the version the learner holds) and refuse groups that do not match "
                       "(policy_mismatch); off only for worker.backend = \"sim\", whose log-probs come from no model")
    samples_per_group: int = rule(1, ge=1, le=1024, doc="samples of each group re-scored, chosen by the learner "
                                  "at random (a worker cannot tell which)")
    token_tolerance: float = rule(0.0, ge=0, le=10, unit="nats", doc="largest |behaviour - recomputed| log-prob "
                                  "of a matching token; 0 = by the engine's and the learner's dtypes (float32 "
                                  "both: 0.01, else 0.25; common/integrity.py)")
    max_off_fraction: float = rule(0.1, ge=0, le=1, doc="a checked sample fails when more than this share of "
                                   "its tokens is off by more than the tolerance (and, with bf16 on either side, "
                                   "more than one: one noisy token fails nothing)")
    probation_groups: int = rule(16, ge=0, le=1_000_000, unit="groups", doc="groups of a worker process that must "
                                 "pass the check in a row before it is trusted; until then every group is re-scored "
                                 "(learner/trust.py)")
    audit_fraction: float = rule(0.0625, gt=0, le=1, doc="share of learner steps on which a trusted worker's tokens of "
                                 "older versions are re-scored (drawn secretly per step; 1 = every step, every group: "
                                 "exact for every worker at every step, at the cost of a forward nearly every step)")
    quarantine_after: int = rule(2, ge=1, le=1000, unit="groups", doc="failed groups of one worker process, among "
                                 "its last quarantine_window checked ones, that quarantine it")
    quarantine_window: int = rule(8, ge=1, le=10_000, unit="groups")


@dataclass(slots=True, kw_only=True)
class SecurityConfig:
    enabled: bool = rule(False, doc="CURVE authentication and encryption on every socket")
    keys_dir: str = rule("", doc="directory made by `loraflow keys`")
    client_key: str = rule("", doc="name of this client's key pair in keys_dir (e.g. gpu-3); default: the "
                           "client's role (worker, learner, observer)")
    run_token: str = rule("", max_len=128, doc="with security off, a learner's Hello must carry the run token: "
                          "this value (the same on broker and learner), or empty: the broker writes a random one "
                          "to run_token_file on its first start and the learner reads it there (common/run_token.py)")
    run_token_file: str = rule("", doc="where the run token is kept; default <run_dir>/broker/run_token (a learner "
                               "on another host: a copy of the broker's)")


@dataclass(slots=True, kw_only=True)
class LaunchConfig:
    """What `loraflow run` starts on this machine and how it supervises it (other commands ignore it)."""

    num_workers: int = rule(2, ge=0, le=256, doc="rollout workers started (more can join from elsewhere)")
    shared_workers: int = rule(0, ge=0, le=256, doc="loraflow pool: workers that serve every run in one engine "
                               "(worker.pool); 0 = launch.num_workers workers of each run's own")
    shared_learner: bool = rule(False, doc="loraflow pool: one learner process trains every run over one base "
                                "(learner.pool); false = a learner process of each run's own")
    learner_ranks: int = rule(1, ge=1, le=1024, doc="learner ranks; above 1 the learner runs under torchrun")
    restart_backoff_s: float = rule(1.0, gt=0, unit="s", doc="first delay before restarting a dead process; doubles")
    max_backoff_s: float = rule(30.0, gt=0, unit="s", doc="longest delay between restarts")
    max_restarts: int = rule(5, ge=0, doc="restarts of one process before the run stops with an error")
    progress_every_s: float = rule(2.0, gt=0, unit="s", doc="refresh period of the progress display")
    share_gpus: bool = rule(True, doc="with fewer GPUs than learner ranks + workers, workers share them "
                            "(round-robin over the GPUs the learner leaves, else all; vLLM workers must fit: "
                            "k x worker.vllm.gpu_memory_utilization <= 1); false = refuse to start")


@dataclass(slots=True, kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.run_dir or f"runs/{self.run.name}")

    @property
    def bind_endpoint(self) -> str:
        return self.broker.bind or self.broker.endpoint

    @property
    def capacity_groups(self) -> int:
        """Buffered + leased groups the broker allows at once."""
        if self.broker.capacity_groups:
            return self.broker.capacity_groups
        return self.run.groups_per_step * (self.run.max_staleness + 1)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML file (or defaults), apply ``section.key=value`` overrides, validate; raises ConfigError."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for override in overrides:
        apply_override(raw, override)
    return from_raw(raw, f"{path}: " if path else "")


def from_raw(raw: dict[str, Any], where: str = "") -> Config:
    """The validated config of a raw mapping (sections of keys, as TOML reads them); ConfigError starts with
    ``where``."""
    try:
        config = build(Config, raw, "config")
    except SchemaError as exc:
        text = str(exc).removeprefix("config.").replace("config: unknown field(s)", "unknown section(s)")
        raise ConfigError(f"{where}{text}") from None
    validate(config)
    return config


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``section.key=value`` (value in TOML syntax, or a bare string) in a raw config mapping."""
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {override!r} must look like section.key=value (e.g. worker.temperature=0.7)")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[parts[-1]] = value


def validate(config: Config) -> None:
    """Rules that span fields; each message says which keys to change."""
    run, learner = config.run, config.learner
    if config.broker.capacity_groups and config.broker.capacity_groups < run.groups_per_step:
        raise ConfigError(f"broker.capacity_groups ({config.broker.capacity_groups}) must be >= run.groups_per_step "
                          f"({run.groups_per_step}), or the learner could never get a full batch")
    if learner.mask_low >= learner.mask_high:
        raise ConfigError(f"learner.mask_low ({learner.mask_low}) must be < learner.mask_high ({learner.mask_high})")
    if config.launch.learner_ranks > 1 and learner.device.startswith("cuda:"):
        raise ConfigError(f"learner.device = {learner.device!r} with launch.learner_ranks = "
                          f"{config.launch.learner_ranks} puts every rank on one GPU: use \"cuda\" (each rank takes "
                          "the GPU of its LOCAL_RANK)")
    if learner.tis_cap < 1:
        raise ConfigError(f"learner.tis_cap ({learner.tis_cap}) must be >= 1 (a cap below 1 shrinks fresh samples)")
    for name, endpoint in (("broker.endpoint", config.broker.endpoint), ("broker.bind", config.broker.bind)):
        if endpoint and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"{name} ({endpoint!r}) must start with tcp://, ipc:// or inproc://")
    try:
        lora_targets.check_setting(learner.target_modules)
    except lora_targets.TargetModulesError as exc:
        raise ConfigError(str(exc)) from None
    check_sampling(config.worker)
    worker = config.worker
    if worker.reward and worker.rewards:
        raise ConfigError("set worker.reward (one function) or worker.rewards (a list), not both")
    if worker.reward_weights and len(worker.reward_weights) != len(worker.rewards):
        raise ConfigError(f"worker.reward_weights has {len(worker.reward_weights)} entries but worker.rewards has "
                          f"{len(worker.rewards)}: give one weight per reward function, or none (1.0 each)")
    if worker.agent and (worker.reward or worker.rewards or worker.backend == "sim"):
        raise ConfigError("worker.agent returns each episode's reward and needs a tokenizer: leave worker.reward "
                          "and worker.rewards empty and use worker.backend = \"hf\" or \"vllm\"")
    gateway_host = worker.gateway_bind.rpartition(":")[0].strip("[]")
    if worker.agent and gateway_host not in ("127.0.0.1", "localhost", "::1") and not config.security.enabled:
        raise ConfigError(f"worker.gateway_bind = {worker.gateway_bind!r} is beyond loopback: set "
                          "security.enabled (the gateway then requires its token) or bind 127.0.0.1")
    if worker.keep_version_within and worker.keep_version_within >= run.max_staleness:
        raise ConfigError(f"worker.keep_version_within ({worker.keep_version_within}) must be below "
                          f"run.max_staleness ({run.max_staleness}): the tokens it keeps on an older version would "
                          "reach the learner too stale to train")
    if worker.vllm.max_loras and worker.vllm.max_loras <= worker.keep_version_within:
        raise ConfigError(f"worker.vllm.max_loras ({worker.vllm.max_loras}) must be > worker.keep_version_within "
                          f"({worker.keep_version_within}): the engine runs the newest version beside the kept ones")
    if config.data.eval_split and config.data.eval_path:
        raise ConfigError("set data.eval_split (a split of the dataset) or data.eval_path (another file), not both")
    if config.integrity.quarantine_after > config.integrity.quarantine_window:
        raise ConfigError(f"integrity.quarantine_after ({config.integrity.quarantine_after}) must be <= "
                          f"integrity.quarantine_window ({config.integrity.quarantine_window})")
    if config.security.enabled and not config.security.keys_dir:
        raise ConfigError("security.enabled needs security.keys_dir (make one with `loraflow keys`)")


#: vLLM raises a sampling temperature below this to it (and samples greedily below 1e-5)
VLLM_MIN_TEMPERATURE = 0.01


def check_sampling(worker: WorkerConfig) -> None:
    """Refuse sampling settings whose behaviour log-probs would not mean what common/logprobs.py promises
    (``log_softmax(logits / temperature)`` of the sampled token, before top-p) on the configured backend."""
    if worker.backend != "vllm":
        return  # hf: computed from generate's raw logits; sim: no model
    if worker.top_p < 1 and worker.temperature != 1:
        raise ConfigError(
            f"worker.top_p = {worker.top_p} with worker.temperature = {worker.temperature} cannot be trained on "
            'with worker.backend = "vllm": vLLM returns the promised log-probs only at temperature 1 (raw logits) '
            "or with top_p = 1 (after temperature, nothing truncated); both together would need every token's "
            "full-vocabulary log-probs, which the engine refuses past max_logprobs (and would cost vocab-size "
            'floats per token). Set worker.top_p = 1 or worker.temperature = 1, or use worker.backend = "hf"')
    if worker.temperature < VLLM_MIN_TEMPERATURE:
        raise ConfigError(
            f"worker.temperature = {worker.temperature} is below {VLLM_MIN_TEMPERATURE}, which vLLM raises it to "
            "(and samples greedily below 1e-5), so the tokens would not come from the temperature the learner "
            f'scores them with: use worker.temperature >= {VLLM_MIN_TEMPERATURE} with worker.backend = "vllm"')


def to_toml(config: Config) -> str:
    """The config as TOML text (the resolved copy written into a run directory)."""
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in scalars.items())
        if prefix:
            lines.append("")
        for k, v in tables.items():
            emit(v, f"{prefix}.{k}" if prefix else k)

    emit(dump(config), "")
    return "\n".join(lines)


def write_resolved(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_toml(config))
    os.replace(tmp, path)
