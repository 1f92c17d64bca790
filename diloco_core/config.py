"""The experiment configuration: one tree of frozen dataclasses, validated on construction.

Every default lives here. A bad value raises `ConfigError` naming the dotted field path and the
reason, before any compute starts. Parsing from mappings, files and CLI overrides lives in
`config_loading.py`; this module only defines and validates.
"""

import dataclasses
import math
from dataclasses import dataclass, field

from diloco_core.presets import MODEL_PRESETS


class ConfigError(ValueError):
    """A configuration value is invalid. `field` is the dotted path of the offending field."""

    def __init__(self, field_path: str, reason: str):
        self.field = field_path
        self.reason = reason
        super().__init__(f"{field_path}: {reason}")

    def prefixed(self, prefix: str) -> "ConfigError":
        return ConfigError(f"{prefix}.{self.field}", self.reason)


# Upper bounds on sizes, so that a typo (an extra zero or six) is refused by name before any
# compute or allocation instead of exhausting memory or Dagster partitions later. Far above
# anything this project runs: the paper's runs use tens of learners.
MAX_LEARNERS = 4096          # each is a Dagster partition, a heartbeat per sensor tick
MAX_SIZE = 1 << 24           # model dimensions, sequence length, sequences per step
MAX_TOKEN_BUDGET = 1 << 62   # the largest integer a store record may carry


def _require(ok: bool, field_path: str, reason: str) -> None:
    if not ok:
        raise ConfigError(field_path, reason)


def _finite_positive(value: float, name: str) -> None:
    _require(isinstance(value, int | float) and math.isfinite(value) and value > 0,
             name, f"must be a finite number > 0, got {value!r}")


def _in_unit(value: float, name: str, *, low_open: bool, high_open: bool) -> None:
    lo_ok = value > 0 if low_open else value >= 0
    hi_ok = value < 1 if high_open else value <= 1
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    _require(isinstance(value, int | float) and math.isfinite(value) and lo_ok and hi_ok,
             name, f"must be in {interval}, got {value!r}")


MODEL_FAMILIES = ("decoder", "vit")
TASK_FAMILIES = {"text": "decoder", "digits": "vit"}   # each task's model family
DIGITS_IMAGE_SIDE = 8   # scikit-learn's digits: 8x8 images, 16 grey levels, 10 classes
DIGITS_CLASSES = 10


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Transformer shape. Build with `ModelConfig.from_preset`.

    `family` "decoder" is the byte-level language model (task "text"); "vit" is a vision
    transformer classifier over image patches (task "digits"). Either has dense MLP blocks, or
    mixture-of-experts blocks when `n_experts` > 0 (`moe.py`).
    """

    preset: str = "small"  # model preset (diloco params lists them); its fields can be overridden
    family: str = "decoder"        # "decoder" (text) | "vit" (images)
    vocab_size: int = 256          # byte-level tokens (decoder only)
    d_model: int = 128             # width of the residual stream
    n_layers: int = 6              # transformer blocks
    n_heads: int = 4               # attention heads (d_model must divide evenly)
    d_ff: int = 512                # hidden width of the gated MLP (of each expert, with MoE)
    max_seq_len: int = 128         # rotary tables (decoder) / position embeddings (vit) cover this
    rope_base: float = 10_000.0    # rotary position embedding base
    dtype: str = "float32"         # activation/compute dtype; params are always float32
    n_experts: int = 0             # 0: dense MLP blocks; E > 0: mixture of E experts per block
    experts_per_token: int = 2     # top-k routing (MoE only)
    router_aux_weight: float = 0.01  # weight of the load-balancing loss in training (MoE only)
    patch_size: int = 2            # vit: square patches of patch_size x patch_size pixels

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            _require(isinstance(value, int) and 0 < value <= MAX_SIZE, name,
                     f"must be a positive integer <= {MAX_SIZE}, got {value!r}")
        _require(self.d_model % self.n_heads == 0, "n_heads",
                 f"must divide d_model ({self.d_model}), got {self.n_heads}")
        _require((self.d_model // self.n_heads) % 2 == 0, "n_heads",
                 f"head dimension d_model/n_heads = {self.d_model // self.n_heads} must be even "
                 "(rotary embeddings rotate pairs)")
        _finite_positive(self.rope_base, "rope_base")
        _require(self.dtype in ("float32", "bfloat16"), "dtype",
                 f"must be 'float32' or 'bfloat16', got {self.dtype!r}")
        _require(self.family in MODEL_FAMILIES, "family",
                 f"must be one of {', '.join(MODEL_FAMILIES)}, got {self.family!r}")
        for name in ("n_experts", "experts_per_token", "patch_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     name, f"must be an integer >= 0, got {value!r}")
        if self.n_experts:
            _require(1 <= self.experts_per_token <= self.n_experts, "experts_per_token",
                     f"must be in [1, n_experts={self.n_experts}], got {self.experts_per_token}")
        _require(isinstance(self.router_aux_weight, int | float)
                 and math.isfinite(self.router_aux_weight) and self.router_aux_weight >= 0,
                 "router_aux_weight", f"must be a finite number >= 0, got "
                 f"{self.router_aux_weight!r}")
        _require(self.patch_size >= 1, "patch_size", f"must be >= 1, got {self.patch_size}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in MODEL_PRESETS:
            raise ConfigError("preset", f"unknown preset {name!r}; choose one of "
                              f"{', '.join(sorted(MODEL_PRESETS))}")
        return cls(preset=name, **{**MODEL_PRESETS[name], **overrides})


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from and how they are packed."""

    corpus: str = "stdlib"         # "stdlib" (the interpreter's own library source) or a glob
    seq_len: int = 128             # tokens per training sequence
    batch_size: int = 16           # sequences per learner step
    heldout_fraction: float = 0.05  # share of the corpus held out for evals

    def __post_init__(self):
        _require(isinstance(self.corpus, str) and self.corpus.strip() != "", "corpus",
                 "must be 'stdlib' or a non-empty glob of text files")
        _require(isinstance(self.seq_len, int) and 2 <= self.seq_len <= MAX_SIZE, "seq_len",
                 f"must be an integer in [2, {MAX_SIZE}], got {self.seq_len!r}")
        _require(isinstance(self.batch_size, int) and 1 <= self.batch_size <= MAX_SIZE,
                 "batch_size", f"must be a positive integer <= {MAX_SIZE}, got {self.batch_size!r}")
        _in_unit(self.heldout_fraction, "heldout_fraction", low_open=True, high_open=True)


@dataclass(frozen=True, kw_only=True)
class InnerOptConfig:
    """Each learner's AdamW with linear warmup, cosine (or constant) decay and clipping."""

    # Peak inner learning rate. 6e-3 is data-parallel's best of 3e-3, 6e-3 and 1e-2 at 1M tokens
    # on the `small` model, and the DiLoCos' best too (quality experiment 12).
    lr: float = 6e-3
    b1: float = 0.9                # AdamW beta1
    b2: float = 0.95               # AdamW beta2
    eps: float = 1e-8              # AdamW epsilon
    weight_decay: float = 0.1      # AdamW decoupled weight decay
    warmup_steps: int = 20         # linear warmup from 0 to lr
    schedule: str = "cosine"       # "cosine" | "constant"
    decay_steps: int = 0           # 0: derived from the token budget
    min_lr_ratio: float = 0.1      # cosine floor as a fraction of lr
    clip_norm: float = 1.0         # 0 disables clipping

    def __post_init__(self):
        _finite_positive(self.lr, "lr")
        _in_unit(self.b1, "b1", low_open=False, high_open=True)
        _in_unit(self.b2, "b2", low_open=False, high_open=True)
        _finite_positive(self.eps, "eps")
        _require(self.weight_decay >= 0 and math.isfinite(self.weight_decay), "weight_decay",
                 f"must be >= 0, got {self.weight_decay!r}")
        _require(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "warmup_steps",
                 f"must be an integer >= 0, got {self.warmup_steps!r}")
        _require(self.schedule in ("cosine", "constant"), "schedule",
                 f"must be 'cosine' or 'constant', got {self.schedule!r}")
        _require(isinstance(self.decay_steps, int) and self.decay_steps >= 0, "decay_steps",
                 f"must be an integer >= 0, got {self.decay_steps!r}")
        _in_unit(self.min_lr_ratio, "min_lr_ratio", low_open=False, high_open=False)
        _require(self.clip_norm >= 0 and math.isfinite(self.clip_norm), "clip_norm",
                 f"must be >= 0 (0 disables), got {self.clip_norm!r}")


@dataclass(frozen=True, kw_only=True)
class OuterOptConfig:
    """The syncer's SGD with Nesterov momentum, applied to the merged outer gradient."""

    lr: float = 0.7                # outer learning rate
    # Outer momentum (one state per fragment). 0.5, not the 0.9 of runs with H = 500 inner
    # steps: here consecutive outer gradients point the same way, and Nesterov momentum
    # multiplies a steady step by 1 / (1 - mu): 10 at 0.9, 2 at 0.5. At 1M tokens (quality
    # experiment 12), H = 16 (7 outer steps per fragment): 0.5 and 0.9 end level (2.025 vs
    # 2.023); H = 8 (15 outer steps): 0.9 ends at 2.163, 0.5 at 2.002, the best of every arm.
    momentum: float = 0.5
    nesterov: bool = True          # Nesterov momentum (else heavy ball)
    # Outer steps over which each fragment's momentum ramps linearly from 0 to `momentum` (0:
    # full momentum from the first step). A fragment's first steps then move by about lr times
    # the learners' average instead of compounding an unsettled momentum buffer: at about 8
    # outer steps per fragment, 8 ends 7.5% lower in held-out loss than no warm-up, and better
    # than plain averaging (outer lr 1, no momentum) or 16 (quality experiment 12).
    momentum_warmup_steps: int = 8
    # The P final rounds after STOP: "average" publishes the weighted average of the learners'
    # fragments (outer lr 1, no momentum); "outer_step" treats them like any round. The final
    # rounds carry little new progress, so an outer step there is mostly momentum. Measured
    # (benchmarks/final_rounds.py): at momentum 0.9 "average" ends 0.07-0.11 lower in held-out
    # loss; at today's 0.5 with warm-up the step is 0.004 (0.18%) lower. "average" never
    # extrapolates, so its worst case is the smaller one.
    final_rounds: str = "average"
    # "constant": every outer step at `lr`. "inner": the outer lr follows the inner schedule's
    # cosine (down to inner.min_lr_ratio of `lr`) over the outer steps a fragment takes in the
    # run (inner steps per learner / sync_period), so that late rounds, whose learners barely
    # move, are not pushed by a full-size step and the momentum they carry.
    lr_schedule: str = "constant"

    def __post_init__(self):
        _finite_positive(self.lr, "lr")
        _require(self.lr_schedule in OUTER_LR_SCHEDULES, "lr_schedule",
                 f"must be one of {OUTER_LR_SCHEDULES}, got {self.lr_schedule!r}")
        _in_unit(self.momentum, "momentum", low_open=False, high_open=True)
        _require(isinstance(self.momentum_warmup_steps, int) and self.momentum_warmup_steps >= 0,
                 "momentum_warmup_steps",
                 f"must be an integer >= 0, got {self.momentum_warmup_steps!r}")
        _require(self.final_rounds in FINAL_ROUND_STEPS, "final_rounds",
                 f"must be one of {FINAL_ROUND_STEPS}, got {self.final_rounds!r}")


FINAL_ROUND_STEPS = ("outer_step", "average")
OUTER_LR_SCHEDULES = ("constant", "inner")
MERGE_RULES = ("rda", "mean")
RECEIVE_RULES = ("overwrite", "blend", "rebase")
WEIGHTINGS = ("tokens", "uniform")
ENCODINGS = ("fp32", "bf16", "int8", "int4", "int2")
ANCHORS = ("global", "base")
SYNCER_MODES = ("service", "sensor")
# Automatic rounds_per_partition keeps a run's round partitions at or under this, a tenth of
# Dagster's advised ~100,000 per asset, so several experiments fit on one instance.
ROUND_PARTITIONS_MAX = 10_000


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Fragments, schedule, quorum, grace window and how outer gradients travel and merge."""

    num_fragments: int = 4         # P
    sync_period: int = 16          # H: inner steps between two syncs of one fragment
    overlap_steps: int = 1         # tau: steps a fragment may be in flight before it must land
    # Pacing (`round_protocol.held_by_pacing`), the same rule in the simulator and on the real
    # path: a learner waits (idle) while it is tau steps past an offer whose merged fragment
    # has not arrived, or H/P + tau steps past the newest opened round. With tau = 0 it is
    # synchronous DiLoCo's barrier at every sync. The default is chosen by measurement
    # (benchmarks/pacing.py, docs/results.md).
    block_on_overlap: bool = False
    min_quorum: int = 1            # K
    grace_gamma: float = 0.8       # gamma: share of the slack the grace window may use (0: none)
    grace_min_seconds: float = 0.0  # floor of the grace window after quorum
    grace_max_seconds: float = math.inf  # cap of the grace window
    ema_decay: float = 0.9         # running estimates of step / quorum / sync times
    merge_rule: str = "rda"        # rda (non-embedding tensors) + weighted mean (embeddings)
    weighting: str = "tokens"      # tokens: w = tokens^2 / steps; uniform: w = 1
    receive_rule: str = "overwrite"  # or "blend", or "rebase" (keep progress since the offer)
    blend_alpha: float = 0.5       # theta <- alpha * local + (1 - alpha) * global, for "blend"
    encoding: str = "bf16"         # outer-gradient wire format
    encoding_block_size: int = 64  # values per scale for int8/int4/int2
    max_norm_ratio: float = 10.0   # exclude an outer grad > this x the others' median per step
    # A learner's counters are claims (diloco_core/corroboration.py): an offer is credited at
    # most this x H x (1 + its staleness) steps, and a heartbeat's total tokens at most this x
    # the other live learners' median; 4 leaves room for learners 2.5x apart in speed (the
    # heterogeneous-speed experiment). inf trusts every claim.
    max_speed_ratio: float = 4.0
    # The most tokens a second any learner's hardware can process, if the deployment declares
    # it: a heartbeat's total then counts toward the budget and the opening of rounds at most
    # its total when the syncer's account of it began plus this x the seconds since, by the
    # syncer's clock (plus one sync period). The one bound that does not lean on the other
    # learners: with M = 2 a liar gains at most this rate. inf: not declared.
    max_learner_tokens_per_second: float = math.inf
    # No member's merge weight above max(this, 1 / members), or the share its configured batch
    # gives it if larger: one learner, whatever it claims, weighs at most 3x the rest of its
    # round together. 0.75 keeps honest token weighting between two members 3x apart in steps
    # (one that rejoined, or a slow one); 0.5 would make every two-member round an equal
    # average. 1 disables.
    max_weight_share: float = 0.75
    anchor: str = "global"         # outer grad vs the current global ("global", the paper)
    # or vs the version the learner started from ("base")

    def __post_init__(self):
        _require(isinstance(self.block_on_overlap, bool), "block_on_overlap",
                 f"must be true or false, got {self.block_on_overlap!r}")
        for name in ("num_fragments", "sync_period", "min_quorum", "encoding_block_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name,
                     f"must be an integer >= 1, got {value!r}")
        _require(isinstance(self.overlap_steps, int) and self.overlap_steps >= 0,
                 "overlap_steps", f"must be an integer >= 0, got {self.overlap_steps!r}")
        _require(self.sync_period % self.num_fragments == 0, "sync_period",
                 f"must be a multiple of num_fragments ({self.num_fragments}) so fragments are "
                 f"evenly staggered, got {self.sync_period}")
        _in_unit(self.grace_gamma, "grace_gamma", low_open=False, high_open=True)
        _require(self.grace_min_seconds >= 0 and math.isfinite(self.grace_min_seconds),
                 "grace_min_seconds",
                 f"must be a finite number >= 0, got {self.grace_min_seconds!r}")
        _require(self.grace_max_seconds >= self.grace_min_seconds, "grace_max_seconds",
                 f"must be >= grace_min_seconds ({self.grace_min_seconds}), "
                 f"got {self.grace_max_seconds!r}")
        _in_unit(self.ema_decay, "ema_decay", low_open=False, high_open=True)
        for name, allowed in (("merge_rule", MERGE_RULES), ("weighting", WEIGHTINGS),
                              ("receive_rule", RECEIVE_RULES), ("encoding", ENCODINGS),
                              ("anchor", ANCHORS)):
            value = getattr(self, name)
            _require(value in allowed, name, f"must be one of {', '.join(allowed)}, got {value!r}")
        _in_unit(self.blend_alpha, "blend_alpha", low_open=False, high_open=True)
        _require(isinstance(self.max_speed_ratio, int | float) and self.max_speed_ratio >= 1,
                 "max_speed_ratio", f"must be a number >= 1 (inf disables), "
                                    f"got {self.max_speed_ratio!r}")
        _require(isinstance(self.max_learner_tokens_per_second, int | float)
                 and self.max_learner_tokens_per_second > 0, "max_learner_tokens_per_second",
                 f"must be a number > 0 (inf: not declared), "
                 f"got {self.max_learner_tokens_per_second!r}")
        _require(isinstance(self.max_weight_share, int | float)
                 and 0 < self.max_weight_share <= 1, "max_weight_share",
                 f"must be a number in (0, 1], got {self.max_weight_share!r}")
        _require(isinstance(self.max_norm_ratio, int | float) and self.max_norm_ratio > 1,
                 "max_norm_ratio", f"must be a number > 1 (inf disables), "
                                   f"got {self.max_norm_ratio!r}")

    @property
    def round_interval_steps(self) -> int:
        """Learner steps between two consecutive rounds (of consecutive fragments)."""
        return self.sync_period // self.num_fragments


@dataclass(frozen=True, kw_only=True)
class LearnersConfig:
    """The M learners: names, regions and relative speeds."""

    num_learners: int = 4          # M
    names: tuple[str, ...] = ()    # default: learner-0 .. learner-{M-1}
    regions: tuple[str, ...] = ()  # default: "local" for every learner
    speeds: tuple[float, ...] = ()  # relative step rate (1.0 = nominal, 0.5 = half as fast)
    # Sequences per inner step, per learner (default: data.batch_size for every learner). Unequal
    # batches model learners on hardware of different sizes; the merge weights tokens^2/steps
    # then favour the learners that processed more tokens per step.
    batch_sizes: tuple[int, ...] = ()
    # How a learner holds its state across the devices of its slice (`diloco_core/spmd.py`):
    # "replicated" (a full copy per device) or "fsdp" (each array split across the devices:
    # ~1/N of the params and AdamW state per device, for models that do not fit replicated).
    sharding: str = "replicated"
    # Share of the token budget trained data-parallel (one lock-step AdamW step on all the
    # learners' batches together) before the learners fork from its parameters and AdamW state;
    # 0: the learners start apart from the first step. Reference simulator only for now.
    warm_start_fraction: float = 0.0
    # Orchestrated runs: the last `standby` learners of the roster start without capacity (not
    # launched); `diloco capacity --join`, the `capacity` job or a fault tape's learner_join
    # brings them in while the run goes on (scavenged capacity), and --leave releases any
    # learner. Each keeps its own data shard, so data stays disjoint as the learner set
    # changes. The simulator's counterpart is simulation.capacity.
    standby: int = 0

    def __post_init__(self):
        _require(isinstance(self.num_learners, int) and not isinstance(self.num_learners, bool)
                 and 1 <= self.num_learners <= MAX_LEARNERS, "num_learners",
                 f"must be an integer in [1, {MAX_LEARNERS}], got {self.num_learners!r}")
        _require(isinstance(self.standby, int) and not isinstance(self.standby, bool)
                 and 0 <= self.standby < self.num_learners, "standby",
                 f"must be an integer in [0, num_learners - 1 = {self.num_learners - 1}], got "
                 f"{self.standby!r}")
        _in_unit(self.warm_start_fraction, "warm_start_fraction", low_open=False,
                 high_open=True)
        _require(self.sharding in ("replicated", "fsdp"), "sharding",
                 f"must be one of replicated, fsdp, got {self.sharding!r}")
        for name in ("names", "regions", "speeds", "batch_sizes"):
            value = getattr(self, name)
            _require(len(value) in (0, self.num_learners), name,
                     f"has {len(value)} entries but num_learners is {self.num_learners}")
        for i, s in enumerate(self.speeds):
            _finite_positive(s, f"speeds[{i}]")
        for i, b in enumerate(self.batch_sizes):
            _require(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_SIZE,
                     f"batch_sizes[{i}]", f"must be a positive integer <= {MAX_SIZE}, got {b!r}")
        for name in ("names", "regions"):
            for i, value in enumerate(getattr(self, name)):
                _require(_is_safe_name(value), f"{name}[{i}]",
                         f"must match [a-z0-9][a-z0-9-_]{{0,62}}, got {value!r}")
        _require(len(set(self.names)) == len(self.names), "names", "must be unique")

    @property
    def learner_names(self) -> tuple[str, ...]:
        return self.names or tuple(f"learner-{i}" for i in range(self.num_learners))

    @property
    def learner_speeds(self) -> tuple[float, ...]:
        return self.speeds or (1.0,) * self.num_learners

    @property
    def learner_regions(self) -> tuple[str, ...]:
        return self.regions or ("local",) * self.num_learners

    @property
    def standby_names(self) -> tuple[str, ...]:
        """The learners that start without capacity (the roster's last `standby`)."""
        return self.learner_names[self.num_learners - self.standby:]


def _is_safe_name(value: object) -> bool:
    import re

    return isinstance(value, str) and re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", value) is not None


@dataclass(frozen=True, kw_only=True)
class Outage:
    """A learner is down (process gone, contributes nothing) from `start` to `end` seconds."""

    learner: int
    start: float
    end: float

    def __post_init__(self):
        _require(isinstance(self.learner, int) and self.learner >= 0, "learner",
                 f"must be a learner index >= 0, got {self.learner!r}")
        _require(self.start >= 0 and math.isfinite(self.start), "start",
                 f"must be a finite time >= 0, got {self.start!r}")
        _require(self.end > self.start, "end",
                 f"must be after start ({self.start}), got {self.end!r}")


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """Compute that is part of the run only for a while (scavenged capacity): learner `learner`
    joins at `join` and leaves at `leave`, as fractions of the run's nominal length (the time a
    speed-1.0 learner takes for the run's steps, `ExperimentConfig.nominal_run_seconds`)."""

    learner: int
    join: float
    leave: float = 1.0

    def __post_init__(self):
        _require(isinstance(self.learner, int) and self.learner >= 0, "learner",
                 f"must be a learner index >= 0, got {self.learner!r}")
        _require(isinstance(self.join, int | float) and 0 <= self.join < 1, "join",
                 f"must be a fraction of the run in [0, 1), got {self.join!r}")
        _require(isinstance(self.leave, int | float) and self.join < self.leave <= 1, "leave",
                 f"must be after join ({self.join}) and at most 1, got {self.leave!r}")

    @property
    def presence(self) -> float:
        return self.leave - self.join


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """The reference simulator's fake clock: step times, sync latency and the failure schedule."""

    step_seconds: float = 1.0      # nominal inner-step time of a speed-1.0 learner
    step_jitter: float = 0.0       # relative std-dev of each step time (e.g. 0.1 = 10%)
    sync_seconds: float = 0.3      # merge + transfer latency from decision to delivery
    outages: tuple[Outage, ...] = ()  # learner outages: {learner, start, end} seconds
    # Scavenged capacity: learners present only from `join` to `leave` (fractions of the run),
    # {learner, join, leave}; a joining learner starts from the global parameters and a peer's
    # AdamW state, a leaving one is gone for good. Learners not listed are there throughout.
    capacity: tuple[Capacity, ...] = ()
    eval_points: int = 8           # held-out evals of the global params, evenly over the budget
    eval_batches: int = 4          # held-out batches per eval

    def __post_init__(self):
        _finite_positive(self.step_seconds, "step_seconds")
        _require(0 <= self.step_jitter < 1, "step_jitter",
                 f"must be in [0, 1), got {self.step_jitter!r}")
        _require(self.sync_seconds >= 0 and math.isfinite(self.sync_seconds), "sync_seconds",
                 f"must be a finite number >= 0, got {self.sync_seconds!r}")
        _require(isinstance(self.eval_points, int) and self.eval_points >= 1,
                 "eval_points", f"must be an integer >= 1, got {self.eval_points!r}")
        _require(isinstance(self.eval_batches, int) and self.eval_batches >= 1, "eval_batches",
                 f"must be an integer >= 1, got {self.eval_batches!r}")


@dataclass(frozen=True, kw_only=True)
class OrchestrationConfig:
    """How the orchestrated run (learner processes + Dagster sensors) paces and heals itself.

    These are wall-clock settings of the real system; the reference simulator ignores them.
    """

    heartbeat_seconds: float = 2.0        # how often a learner publishes its progress
    poll_seconds: float = 0.5             # how often a learner looks for open rounds / merges
    checkpoint_every_steps: int = 50      # learner Orbax checkpoints (params, AdamW, data position)
    # Checkpoints written in the background (Orbax async) while the learner trains on; only a
    # finished one is reported. False: every save blocks the loop until durable. A learner that
    # spans several processes always blocks (its arrays are not all on one host).
    async_checkpoints: bool = True
    learner_timeout_seconds: float = 60.0  # heartbeat older than this: the learner counts as down
    # A learner process's first inner step compiles the step program (minutes for a large model
    # on a TPU slice); it keeps heartbeating through it for at most this long.
    compile_timeout_seconds: float = 1800.0
    restart_backoff_seconds: float = 5.0  # first relaunch delay; doubles per consecutive failure
    restart_backoff_max_seconds: float = 60.0  # cap of the relaunch delay
    # Launches of one learner (or of the syncer) within restart_window_seconds; past it the
    # supervisor waits for the oldest to leave the window. Per window, so that a week of
    # preemptions never exhausts it while a crash loop is still held to this rate.
    max_restarts: int = 20
    restart_window_seconds: float = 3600.0  # the window max_restarts counts launches in
    rejoin_max_versions_behind: int = 2   # own checkpoint is fresh if no fragment is further behind
    round_timeout_seconds: float = 300.0  # a final round stops waiting for silent learners
    eval_batches: int = 4                 # held-out batches per round eval
    # Emulated hardware: pad each inner step to at least step_seconds_floor / speed seconds
    # (0: steps take what the machine takes; slower learners sleep (1/speed - 1) x that).
    step_seconds_floor: float = 0.0
    # Who decides and merges rounds. "service": one long-lived syncer process per experiment
    # (dispatched and supervised by Dagster like a learner, fenced by a lease in the store)
    # polls the store every syncer_poll_seconds and merges within a second; the quorum sensor
    # only mirrors its records into Dagster, and takes over (one merge run per round) while
    # the syncer's lease has not changed for syncer_timeout_seconds. "sensor": the quorum
    # sensor decides every round and each merge is a Dagster run (seconds per round).
    syncer: str = "service"
    # 0.25 s: a decision waits at most that for the poll that sees its last offer; polling
    # faster cost the 2-core demo's learners a measurable share of a core.
    syncer_poll_seconds: float = 0.25
    syncer_timeout_seconds: float = 20.0  # lease unchanged this long: the sensor takes over
    # The syncer evaluates the global model after every this many merged rounds (0: once per
    # outer step, i.e. every P rounds); the sensor-run merges evaluate every round.
    eval_every_rounds: int = 0
    # Rounds per Dagster partition of the round assets (0: automatic). Dagster advises at most
    # ~100,000 partitions per asset, and at the paper's cadence (a fragment round every step)
    # a month-long run makes millions of rounds: automatic keeps one partition per round while
    # the run's expected rounds fit in ROUND_PARTITIONS_MAX, and otherwise groups whole outer
    # steps (multiples of P rounds) so that they do. Each merge stays its own
    # materialization, with its round in the metadata, inside its partition.
    rounds_per_partition: int = 0
    # Retention, applied by the syncer service after its merges: the arrays of global versions
    # older than the newest keep_global_versions of their fragment, and of the contributions
    # to rounds more than keep_contribution_rounds rounds old, are deleted. Manifests and
    # records stay readable (the token ledger and the run summary read them), packed 64 rounds
    # or versions to an object once pruned; version 0 and the current version stay whole. A
    # merge refuses a contribution whose base version was deleted, so keep_global_versions
    # also bounds the staleness a merge accepts. 0: keep everything.
    keep_global_versions: int = 16      # newest versions per fragment whose arrays stay
    keep_contribution_rounds: int = 64  # newest rounds whose contributions' arrays stay
    # A directory for TensorBoard event files of the per-round figures and evals (written by
    # the syncer and the merge runs, one subdirectory per experiment); empty: none.
    tensorboard_dir: str = ""
    # A directory on each host where the learners and the syncer keep XLA's compiled programs
    # (JAX's persistent compilation cache), so that a relaunched process (a preemption, a kill,
    # the next run) skips recompiling its step. Keyed by the program itself, so it never serves
    # stale code. A local path, never the store: a compiled program is code, and a party that
    # may write the store must not choose what another process executes. Empty: off.
    compilation_cache_dir: str = "~/.cache/diloco/jax"
    # A chaos run: the experiment's fault tape (faults/tape.json) is injected into its
    # learners, merges, syncer and capacity. Set by the chaos tooling (`diloco demo
    # --fault-tape`, the chaos soaks, the test harness); the train job refuses a fault tape
    # without it. Off: a tape in the store is ignored, with a logged reason.
    chaos: bool = False

    def __post_init__(self):
        _require(isinstance(self.chaos, bool), "chaos",
                 f"must be true or false, got {self.chaos!r}")
        _require(isinstance(self.async_checkpoints, bool), "async_checkpoints",
                 f"must be true or false, got {self.async_checkpoints!r}")
        _require(isinstance(self.tensorboard_dir, str) and len(self.tensorboard_dir) <= 1024,
                 "tensorboard_dir", f"must be a path (or empty), got {self.tensorboard_dir!r}")
        _require(isinstance(self.compilation_cache_dir, str)
                 and len(self.compilation_cache_dir) <= 1024
                 and "://" not in self.compilation_cache_dir, "compilation_cache_dir",
                 f"must be a local directory (or empty), got {self.compilation_cache_dir!r}")
        _require(self.syncer in SYNCER_MODES, "syncer",
                 f"must be one of {', '.join(SYNCER_MODES)}, got {self.syncer!r}")
        for name in ("heartbeat_seconds", "poll_seconds", "learner_timeout_seconds",
                     "compile_timeout_seconds", "restart_backoff_seconds",
                     "restart_backoff_max_seconds", "round_timeout_seconds",
                     "restart_window_seconds",
                     "syncer_poll_seconds", "syncer_timeout_seconds"):
            _finite_positive(getattr(self, name), name)
        _require(self.step_seconds_floor >= 0 and math.isfinite(self.step_seconds_floor),
                 "step_seconds_floor",
                 f"must be a finite number >= 0, got {self.step_seconds_floor!r}")
        for name, low in (("checkpoint_every_steps", 1), ("max_restarts", 0),
                          ("rejoin_max_versions_behind", 0), ("eval_batches", 1),
                          ("eval_every_rounds", 0), ("rounds_per_partition", 0),
                          ("keep_global_versions", 0), ("keep_contribution_rounds", 0)):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                     name, f"must be an integer >= {low}, got {value!r}")
        # The current version and the one before it: a learner's offer is based on one of them
        # unless it is slower than a whole round of its fragment.
        _require(self.keep_global_versions != 1, "keep_global_versions",
                 "must be 0 (keep all) or >= 2 (the current version and the one before)")
        # The syncer renews its lease every second: a shorter timeout would mistake a slow
        # store write for a dead syncer.
        _require(self.syncer_timeout_seconds >= 3.0, "syncer_timeout_seconds",
                 f"must be >= 3 (the lease is renewed every second), got "
                 f"{self.syncer_timeout_seconds}")
        _require(self.learner_timeout_seconds > self.heartbeat_seconds, "learner_timeout_seconds",
                 f"must exceed heartbeat_seconds ({self.heartbeat_seconds}), "
                 f"got {self.learner_timeout_seconds}")


def _default_model() -> ModelConfig:
    return ModelConfig.from_preset("small")


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """Everything one training run needs. Sub-configs validate themselves; cross-field checks
    live here."""

    name: str = "diloco-demo"      # names the experiment's storage prefix
    seed: int = 0                  # model init, data order and simulated jitter
    # "text": next-byte prediction on the corpus (decoder family). "digits": classification of
    # scikit-learn's 8x8 handwritten digits (vit family); there a "token" is one image, so
    # token_budget, batch sizes and the merge weights count images.
    task: str = "text"
    token_budget: int = 1_000_000  # tokens processed by all learners together
    model: ModelConfig = field(default_factory=_default_model)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptConfig = field(default_factory=InnerOptConfig)
    outer: OuterOptConfig = field(default_factory=OuterOptConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    learners: LearnersConfig = field(default_factory=LearnersConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)

    def __post_init__(self):
        _require(_is_safe_name(self.name), "name",
                 "must match [a-z0-9][a-z0-9_-]{0,62} (it names storage prefixes), "
                 f"got {self.name!r}")
        _require(isinstance(self.seed, int) and self.seed >= 0, "seed",
                 f"must be an integer >= 0, got {self.seed!r}")
        _require(isinstance(self.token_budget, int) and not isinstance(self.token_budget, bool)
                 and 0 < self.token_budget <= MAX_TOKEN_BUDGET, "token_budget",
                 f"must be an integer in [1, 2**62], got {self.token_budget!r}")
        _require(self.task in TASK_FAMILIES, "task",
                 f"must be one of {', '.join(TASK_FAMILIES)}, got {self.task!r}")
        family = TASK_FAMILIES[self.task]
        _require(self.model.family == family, "model.family",
                 f"task {self.task!r} needs a {family!r} model (e.g. preset "
                 f"{'vit-digits' if family == 'vit' else 'small'!r}), got {self.model.family!r}")
        m = self.learners.num_learners
        _require(self.sync.min_quorum <= m, "sync.min_quorum",
                 f"must be <= learners.num_learners ({m}), got {self.sync.min_quorum}")
        _require(self.sync.min_quorum <= m - self.learners.standby, "learners.standby",
                 f"leaves {m - self.learners.standby} learners at the start, fewer than "
                 f"sync.min_quorum ({self.sync.min_quorum}): no round could merge")
        if self.task == "text":
            _require(self.data.seq_len <= self.model.max_seq_len, "data.seq_len",
                     f"must be <= model.max_seq_len ({self.model.max_seq_len}), "
                     f"got {self.data.seq_len}")
        else:
            p = self.model.patch_size
            _require(DIGITS_IMAGE_SIDE % p == 0, "model.patch_size",
                     f"must divide the {DIGITS_IMAGE_SIDE}x{DIGITS_IMAGE_SIDE} digit images, "
                     f"got {p}")
            patches = (DIGITS_IMAGE_SIDE // p) ** 2
            _require(patches <= self.model.max_seq_len, "model.max_seq_len",
                     f"must be >= the {patches} patches of an image, got "
                     f"{self.model.max_seq_len}")
        _require(not (self.learners.warm_start_fraction and self.simulation.outages),
                 "learners.warm_start_fraction",
                 "cannot be combined with simulation.outages (the data-parallel phase does not "
                 "model failures)")
        listed = [c.learner for c in self.simulation.capacity]
        for i, c in enumerate(self.simulation.capacity):
            _require(c.learner < m, f"simulation.capacity[{i}].learner",
                     f"must be < learners.num_learners ({m}), got {c.learner}")
            _require(c.learner not in listed[:i], f"simulation.capacity[{i}].learner",
                     f"learner {c.learner} is listed more than once")
        if self.simulation.capacity:
            _require(not self.simulation.outages and not self.learners.warm_start_fraction,
                     "simulation.capacity", "cannot be combined with simulation.outages or "
                     "learners.warm_start_fraction")
            at_start = m - sum(1 for c in self.simulation.capacity if c.join > 0)
            _require(self.sync.min_quorum <= at_start, "sync.min_quorum",
                     f"must be <= the {at_start} learners present from the start "
                     "(simulation.capacity)")
        last_end: dict[int, float] = {}
        for i, outage in sorted(enumerate(self.simulation.outages), key=lambda x: x[1].start):
            _require(outage.learner < m, f"simulation.outages[{i}].learner",
                     f"must be < learners.num_learners ({m}), got {outage.learner}")
            _require(outage.start >= last_end.get(outage.learner, -1.0),
                     f"simulation.outages[{i}].start",
                     f"overlaps an earlier outage of learner {outage.learner} "
                     f"(ending at {last_end.get(outage.learner)}); merge them into one")
            last_end[outage.learner] = outage.end
        smallest = min(self.learner_step_tokens)
        _require(smallest <= self.token_budget, "token_budget",
                 f"is smaller than one learner step ({smallest} tokens)")

    @property
    def tokens_per_example(self) -> int:
        """Tokens one batch row counts: seq_len bytes of text, or one image."""
        return self.data.seq_len if self.task == "text" else 1

    @property
    def tokens_per_learner_step(self) -> int:
        """Tokens of one inner step at the nominal batch size (data.batch_size)."""
        return self.data.batch_size * self.tokens_per_example

    @property
    def learner_batch_sizes(self) -> tuple[int, ...]:
        return self.learners.batch_sizes or (self.data.batch_size,) * self.learners.num_learners

    @property
    def learner_step_tokens(self) -> tuple[int, ...]:
        """Tokens of one inner step of each learner."""
        return tuple(b * self.tokens_per_example for b in self.learner_batch_sizes)

    @property
    def total_learner_steps(self) -> int:
        """Inner steps per learner if all M learners step in lock-step until the budget (each
        counted for the share of the run it is present, under `simulation.capacity`)."""
        presence = {c.learner: c.presence for c in self.simulation.capacity}
        # Standby learners are capacity that may never come: the schedule is laid out for the
        # learners sure to be there, so a run where none joins is the run without standby.
        for i in range(self.learners.num_learners - self.learners.standby,
                       self.learners.num_learners):
            presence.setdefault(i, 0.0)
        per_step = sum(tokens * presence.get(i, 1.0)
                       for i, tokens in enumerate(self.learner_step_tokens))
        return max(1, int(self.token_budget // per_step))

    @property
    def outer_steps_per_fragment(self) -> int:
        """Outer steps each fragment takes in the run (the outer lr schedule's horizon)."""
        return max(1, self.total_learner_steps // self.sync.sync_period)

    def capacity_windows(self) -> dict[int, tuple[float, float]]:
        """learner -> (joins, leaves) in simulated seconds for `simulation.capacity` (leaves
        is infinite for a learner that stays to the end; both for a `learners.standby` learner
        with no window: it never joins); learners not listed are present throughout."""
        run_seconds = self.nominal_run_seconds
        windows = {c.learner: (c.join * run_seconds,
                               c.leave * run_seconds if c.leave < 1 else math.inf)
                   for c in self.simulation.capacity}
        # A standby learner without a window never joins (infinite join time).
        for i in range(self.learners.num_learners - self.learners.standby,
                       self.learners.num_learners):
            windows.setdefault(i, (math.inf, math.inf))
        return windows

    @property
    def nominal_run_seconds(self) -> float:
        """The simulated time a speed-1.0 learner takes for `total_learner_steps` steps: the
        run length that `simulation.capacity` fractions refer to."""
        return self.total_learner_steps * self.simulation.step_seconds

    @property
    def expected_rounds(self) -> int:
        """Rounds until the budget if learners step together (a round opens every H/P steps),
        plus the P final rounds."""
        return (self.total_learner_steps // self.sync.round_interval_steps
                + self.sync.num_fragments)

    @property
    def rounds_per_partition(self) -> int:
        """Rounds in one Dagster partition of the round assets (see
        `OrchestrationConfig.rounds_per_partition`)."""
        chosen = self.orchestration.rounds_per_partition
        if chosen:
            return chosen
        if self.expected_rounds <= ROUND_PARTITIONS_MAX:
            return 1
        outer_steps = math.ceil(self.expected_rounds / ROUND_PARTITIONS_MAX
                                / self.sync.num_fragments)
        return outer_steps * self.sync.num_fragments

    def replace(self, **changes) -> "ExperimentConfig":
        return dataclasses.replace(self, **changes)
