"""The experiment configuration: one tree of config sections (`config_section.py`: frozen
dataclasses that pydantic validates on construction).

Every default lives here, and every field's documentation (the string under it: the launchpad
form and `docs/config.md` show it). A bad value raises `ConfigError` naming the dotted field path
and the reason, before any compute starts: a field's own check is part of its type, a check
across fields is in its section's `__post_init__` (across sections, in `ExperimentConfig`'s).
Parsing files and CLI overrides lives in `config_loading.py`; this module only defines.
"""

import dataclasses
import math
import re
from dataclasses import field
from typing import Any

from pydantic import model_validator
from pydantic_core import ArgsKwargs

from diloco_core.config_section import (  # ConfigError: most callers import it from here
    ConfigError,  # noqa: F401
    Count,
    Flag,
    Number,
    PositiveInteger,
    PositiveNumber,
    config_section,
    integer_at_least,
    number_at_least,
    one_of,
    require,
    text,
    unit_interval,
)
from diloco_core.presets import MODEL_PRESETS

# Upper bounds on sizes, so that a typo (an extra zero or six) is refused by name before any
# compute or allocation instead of exhausting memory or Dagster partitions later. Far above
# anything this project runs: the paper's runs use tens of learners.
MAX_LEARNERS = 4096          # each is a Dagster partition, a heartbeat per sensor tick
MAX_SIZE = 1 << 24           # model dimensions, sequence length, sequences per step
MAX_TOKEN_BUDGET = 1 << 62   # the largest integer a store record may carry

Size = integer_at_least(1, MAX_SIZE, f"must be a positive integer <= {MAX_SIZE}")
Fraction = unit_interval(low_open=False, high_open=True)      # [0, 1)
SAFE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# Learner names and regions name storage prefixes, Dagster partitions and service accounts.
SafeName = text(lambda v: SAFE_NAME.fullmatch(v) is not None,
                "must match [a-z0-9][a-z0-9-_]{0,62}")

MODEL_FAMILIES = ("decoder", "vit")
TASK_FAMILIES = {"text": "decoder", "digits": "vit"}   # each task's model family
DIGITS_IMAGE_SIDE = 8   # scikit-learn's digits: 8x8 images, 16 grey levels, 10 classes
DIGITS_CLASSES = 10


@config_section
class ModelConfig:
    """Transformer shape: a preset (`MODEL_PRESETS`), with any of its fields overridden.

    `family` "decoder" is the byte-level language model (task "text"); "vit" is a vision
    transformer classifier over image patches (task "digits"). Either has dense MLP blocks, or
    mixture-of-experts blocks when `n_experts` > 0 (`moe.py`).
    """

    preset: str = "small"
    """model preset (diloco params lists them); its fields can be overridden"""
    family: one_of(*MODEL_FAMILIES) = "decoder"
    """The model family: "decoder" (text) or "vit" (images)."""
    vocab_size: Size = 256
    """byte-level tokens (decoder only)"""
    d_model: Size = 128
    """width of the residual stream"""
    n_layers: Size = 6
    """transformer blocks"""
    n_heads: Size = 4
    """attention heads (d_model must divide evenly)"""
    d_ff: Size = 512
    """hidden width of the gated MLP (of each expert, with MoE)"""
    max_seq_len: Size = 128
    """rotary tables (decoder) / position embeddings (vit) cover this"""
    rope_base: PositiveNumber = 10_000.0
    """rotary position embedding base"""
    dtype: one_of("float32", "bfloat16") = "float32"
    """activation/compute dtype; params are always float32"""
    n_experts: Count = 0
    """0: dense MLP blocks; E > 0: mixture of E experts per block"""
    experts_per_token: Count = 2
    """top-k routing (MoE only)"""
    router_aux_weight: number_at_least(0) = 0.01
    """weight of the load-balancing loss in training (MoE only)"""
    patch_size: PositiveInteger = 2
    """vit: square patches of patch_size x patch_size pixels"""

    @model_validator(mode="before")
    @classmethod
    def _preset_under_overrides(cls, given: Any) -> Any:
        """The preset's fields, then the ones given: `ModelConfig(preset="tiny", n_layers=3)`
        is the tiny model with three layers, whether built in code or from a file."""
        # `ModelConfig()` arrives as ArgsKwargs with no kwargs at all (None).
        kwargs = (given.kwargs or {}) if isinstance(given, ArgsKwargs) else given
        if not isinstance(kwargs, dict):
            return given
        name = kwargs.get("preset", "small")
        require(isinstance(name, str) and name in MODEL_PRESETS, "preset",
                f"unknown preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))}")
        merged = {**MODEL_PRESETS[name], **kwargs}
        return ArgsKwargs(given.args, merged) if isinstance(given, ArgsKwargs) else merged

    def __post_init__(self):
        require(self.d_model % self.n_heads == 0, "n_heads",
                f"must divide d_model ({self.d_model}), got {self.n_heads}")
        require((self.d_model // self.n_heads) % 2 == 0, "n_heads",
                f"head dimension d_model/n_heads = {self.d_model // self.n_heads} must be even "
                "(rotary embeddings rotate pairs)")
        if self.n_experts:
            require(1 <= self.experts_per_token <= self.n_experts, "experts_per_token",
                    f"must be in [1, n_experts={self.n_experts}], got {self.experts_per_token}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        return cls(preset=name, **overrides)


@config_section
class DataConfig:
    """Where tokens come from and how they are packed."""

    corpus: text(lambda v: v.strip() != "",
                 "must be 'stdlib' or a non-empty glob of text files") = "stdlib"
    """Where the text comes from: "stdlib" (the interpreter's own library source) or a glob."""
    seq_len: integer_at_least(2, MAX_SIZE) = 128
    """tokens per training sequence"""
    batch_size: Size = 16
    """sequences per learner step"""
    heldout_fraction: unit_interval(low_open=True, high_open=True) = 0.05
    """share of the corpus held out for evals"""



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


@config_section
class InnerOptConfig:
    """Each learner's AdamW with linear warmup, a constant lr (or a cosine decay) and clipping."""

    lr: PositiveNumber = 8e-3
    """Peak inner learning rate. 8e-3 since issue 38's confirmation: with the clip at 0.5 and the
    40-step warm-up, Decoupled DiLoCo's learners (M = 4, a quarter of the batch each) are the
    only setting tried that meets both of the issue's bars on the confirmation seeds (test
    slice, against data-parallel at its best: 1.0238x at 1M tokens, the default budget, where
    6e-3 gave 1.0336x; 1.0136x at 4M, where 6e-3 gave 1.0077x; quality experiment 1). The
    best peak falls as the budget grows: well past 1M tokens 6e-3 may do better.
    Data-parallel's own best on the `small` model is lower (6e-3 at 1M, 4.5e-3 at 4M; at 8e-3
    it ends 0.9% higher at 1M): a single lock-step job should set 6e-3. `diloco demo` keeps
    6e-3 (`pipelines/launch_defaults.py`): on its constant schedule 8e-3 ended 2-2.5% higher."""
    b1: Fraction = 0.9
    """AdamW beta1"""
    b2: Fraction = 0.95
    """AdamW beta2"""
    eps: PositiveNumber = 1e-8
    """AdamW epsilon"""
    weight_decay: number_at_least(0) = 0.1
    """AdamW decoupled weight decay"""
    warmup_steps: Count = 40
    """Linear warmup from 0 to lr, in inner steps. 40 since issue 38's confirmation, with
    `clip_norm` 0.5: the pair was data-parallel's best of 21 configurations at 1M tokens and its
    best at 4M, and Decoupled DiLoCo's learners with it ended lower than at 20 steps and a clip
    of 1.0 on every confirmation seed at both budgets (test slice, against data-parallel at its
    best: 1.0290x against 1.0348x at 1M, 1.0077x against 1.0131x at 4M; quality experiment 1).
    A 1M-token run of M = 4 learners is about 122 steps a learner, so this is a third of it:
    runs much shorter than that should lower it."""
    schedule: one_of("cosine", "constant", "wsd") = "wsd"
    """After warmup: "wsd" (the peak held, then a linear decay to `min_lr_ratio` of it over the
    horizon's last `wsd_decay_fraction`), "constant" (the peak to the end) or "cosine" (down to
    the floor from the warmup's end). WSD since issue 38: it is data-parallel's best schedule
    at both budgets measured (1M tokens: 1.2% below the constant lr on the selection seeds; 4M:
    4.6% below the constant lr and 0.8% below the cosine on seed 3), and with it and the mean
    merge Decoupled DiLoCo ends 6.4% below the old defaults (RDA, constant lr) at 4M on seed 3.
    At 1M Decoupled DiLoCo's learners do better without the decay (validation 1.771
    constant, 1.783 with a 10% decay, 1.791 with 20%, seeds 0-2): short runs may set
    "constant" (quality experiments 1 and 12). The horizon assumes learners that step alike
    (`ExperimentConfig.total_learner_steps`): a learner much faster than the rest reaches the
    floor early."""
    decay_steps: Count = 0
    """The schedule's horizon in inner steps, warmup included (0: the learner's steps to the
    token budget); past it the lr stays at the floor"""
    min_lr_ratio: unit_interval(low_open=False, high_open=False) = 0.1
    """the floor of "cosine" and "wsd", as a fraction of lr"""
    wsd_decay_fraction: unit_interval(low_open=True, high_open=False) = 0.2
    """For "wsd": the last share of the horizon over which the lr decays linearly from the peak
    to the floor (the peak holds until then). 0.2 is the cooldown Hägele et al. 2024 ("Scaling
    Laws and Compute-Optimal Training Beyond Fixed Training Durations") found to match a cosine
    tuned to the budget."""
    clip_norm: number_at_least(0, note=" (0 disables)") = 0.5
    """The global gradient norm each inner step is clipped to; 0 disables clipping. 0.5 since
    issue 38's confirmation, with the 40-step warm-up (`warmup_steps`); 1.0 before."""


@config_section
class OuterOptConfig:
    """The syncer's SGD with Nesterov momentum, applied to the merged outer gradient."""

    lr: PositiveNumber = 0.5
    """Outer learning rate. 0.5 since issue 38's confirmation: with H = 8 it beat 0.7 on every
    selection seed at 1M tokens (quality experiment 1: 1.042x against 1.057x data-parallel
    without rebase, 1.037x against 1.056x with it)."""
    momentum: Fraction = 0.5
    """Outer momentum (one state per fragment). 0.5, not the 0.9 of runs with H = 500 inner steps:
    here consecutive outer gradients point the same way, and Nesterov momentum multiplies a
    steady step by 1 / (1 - mu): 10 at 0.9, 2 at 0.5. At 1M tokens (quality experiment 12), H =
    16 (7 outer steps per fragment): 0.5 and 0.9 end level (2.025 vs 2.023); H = 8 (15 outer
    steps): 0.9 ends at 2.163, 0.5 at 2.002, the best of every arm."""
    nesterov: Flag = True
    """Nesterov momentum (else heavy ball)"""
    momentum_warmup_steps: Count = 16
    """Outer steps over which each fragment's momentum ramps linearly from 0 to `momentum` (0: full
    momentum from the first step). A fragment's first steps then move by about lr times the
    learners' average instead of compounding an unsettled momentum buffer: at H = 16 (about 8
    outer steps per fragment at 1M tokens) 8 ended 7.5% lower in held-out loss than no warm-up,
    and better than plain averaging (outer lr 1, no momentum) or 16 (quality experiment 12). 16
    since issue 38's confirmation: at H = 4 (about 30 outer steps a fragment at 1M) it beat 8
    on every selection and confirmation seed at 1M (0 and 32 lost on seed 0): against
    data-parallel at its best, 1.022x against 1.036x at 1M and 1.009x against 1.014x at 4M on
    the confirmation seeds (quality experiment 1). Where a fragment takes about as many outer
    steps as the warm-up (0.5M tokens at H = 4, seed 0) 16 and 8 end level: a much shorter run
    or a longer H wants a shorter warm-up (the orchestrated defaults, at H = 16, keep 8)."""
    final_rounds: one_of(*FINAL_ROUND_STEPS) = "average"
    """The P final rounds after STOP: "average" publishes the weighted average of the learners'
    fragments (outer lr 1, no momentum); "outer_step" treats them like any round. The final
    rounds carry little new progress, so an outer step there is mostly momentum. Measured
    (benchmarks/final_rounds.py): at momentum 0.9 "average" ends 0.07-0.11 lower in held-out
    loss; at today's 0.5 with warm-up the step is 0.004 (0.18%) lower. "average" never
    extrapolates, so its worst case is the smaller one."""
    lr_schedule: one_of(*OUTER_LR_SCHEDULES) = "constant"
    """Outer lr schedule. "constant": every outer step at `lr`. "inner": the outer lr follows the
    inner schedule's cosine (down to inner.min_lr_ratio of `lr`) over the outer steps a fragment
    takes in the run (inner steps per learner / sync_period), so that late rounds, whose learners
    barely move, are not pushed by a full-size step and the momentum they carry."""


@config_section
class SyncConfig:
    """Fragments, schedule, quorum, grace window and how outer gradients travel and merge."""

    num_fragments: PositiveInteger = 4
    """P"""
    sync_period: PositiveInteger = 4
    """H: inner steps between two syncs of one fragment. 4 since issue 38's second confirmation
    (with the weighted mean and the WSD inner lr): on `small`, M = 4, the confirmation seeds'
    test slice, 1.023x data-parallel (WSD, lr 6e-3) at 1M tokens and 1.006x at 4M, against
    1.041x and 1.0185x for H = 8, for twice the upload bytes (about 400 against 200 a token at
    bf16, still 4x below data-parallel's all-reduce); against data-parallel at its best lr
    (4.5e-3) 1.036x and 1.014x. H = 8 had replaced H = 16 at the first confirmation (1.0285x
    against 1.0736x, constant inner lr)."""
    overlap_steps: Count = 1
    """tau: steps a fragment may be in flight before it must land"""
    block_on_overlap: Flag = False
    """Pacing (`round_protocol.held_by_pacing`), the same rule in the simulator and on the real
    path: a learner waits (idle) while it is tau steps past an offer whose merged fragment has
    not arrived, or H/P + tau steps past the newest opened round. With tau = 0 it is synchronous
    DiLoCo's barrier at every sync. The default is chosen by measurement (benchmarks/pacing.py,
    docs/results.md)."""
    min_quorum: PositiveInteger = 1
    """K"""
    grace_gamma: Fraction = 0.8
    """gamma: share of the slack the grace window may use (0: none)"""
    grace_min_seconds: number_at_least(0) = 0.0
    """floor of the grace window after quorum"""
    grace_max_seconds: Number = math.inf
    """cap of the grace window"""
    ema_decay: Fraction = 0.9
    """running estimates of step / quorum / sync times"""
    merge_rule: one_of(*MERGE_RULES) = "mean"
    """"mean": the weighted mean of the outer gradients; "rda": radial-directional averaging of
    non-embedding tensors (the weighted mean's direction at the learners' mean norm; diloco_core/
    merge.py), the weighted mean for embeddings. The mean since issue 38: with RDA the merged
    step is about sqrt(M) times the mean's for near-orthogonal outer gradients, and at 1M tokens
    on M = 4 equal learners (constant inner lr) it was the whole of synchronous DiLoCo's lead
    (test slice 1.0063x data-parallel with the mean, 1.0295x with RDA, on the confirmation
    seeds; quality experiment 1). RDA keeps the step's size when the number of members
    changes; the orchestrated defaults, whose rounds merge 2 to 4 learners, keep it until
    measured there."""
    weighting: one_of(*WEIGHTINGS) = "tokens"
    """tokens: w = tokens^2 / steps; uniform: w = 1"""
    receive_rule: one_of(*RECEIVE_RULES) = "rebase"
    """"rebase" (replace what was offered, keep the progress made since), or the paper's
    "overwrite", or "blend". Rebase since issue 38's confirmation: the orchestrated path had it
    first (a late merge under overwrite discarded what a learner trained meanwhile: the chaos
    soak), and on the simulator, at H = 8 and outer lr 0.5, it gained 0.5% of data-parallel's
    loss on the selection seeds and 1.3% on the confirmation seeds (quality experiment 1)."""
    blend_alpha: Fraction = 0.5
    """For "blend": theta <- alpha * local + (1 - alpha) * global."""
    encoding: one_of(*ENCODINGS) = "bf16"
    """outer-gradient wire format"""
    encoding_block_size: PositiveInteger = 64
    """values per scale for int8/int4/int2"""
    max_norm_ratio: number_at_least(1, finite=False, strict=True,
                                    note=" (inf disables)") = 10.0
    """exclude an outer grad > this x the others' median per step"""
    max_speed_ratio: number_at_least(1, finite=False, note=" (inf disables)") = 4.0
    """A learner's counters are claims (diloco_core/corroboration.py): an offer is credited at most
    this x H x (1 + its staleness) steps, or this x the fewest steps another member of its round
    offered if more, and a heartbeat's total tokens toward opening rounds at most this x the
    largest of the other live learners'; 4 leaves room for learners 2.5x apart in speed (the
    heterogeneous-speed experiment). inf trusts every claim."""
    max_learner_tokens_per_second: number_at_least(
        0, finite=False, strict=True, note=" (inf: not declared)") = math.inf
    """The most tokens a second any learner's hardware can process, if the deployment declares it: a
    heartbeat's total then counts toward the budget and the opening of rounds at most its total
    when the syncer's account of it began plus this x the seconds since, by the syncer's clock
    (plus one sync period). The one bound that does not lean on the other learners: with M = 2 a
    liar gains at most this rate. inf: not declared."""
    max_weight_share: unit_interval(low_open=True, high_open=False) = 0.75
    """No member's merge weight above max(this, 1 / members), or the share its configured batch
    gives it if larger: one learner, whatever it claims, weighs at most 3x the rest of its round
    together. 0.75 keeps honest token weighting between two members 3x apart in steps (one that
    rejoined, or a slow one); 0.5 would make every two-member round an equal average. 1 disables."""
    anchor: one_of(*ANCHORS) = "global"
    """The outer gradient against the current global version ("global", the paper) or against the
    version the learner started from ("base")."""

    def __post_init__(self):
        require(self.sync_period % self.num_fragments == 0, "sync_period",
                f"must be a multiple of num_fragments ({self.num_fragments}) so fragments are "
                f"evenly staggered, got {self.sync_period}")
        require(self.grace_max_seconds >= self.grace_min_seconds, "grace_max_seconds",
                f"must be >= grace_min_seconds ({self.grace_min_seconds}), "
                f"got {self.grace_max_seconds!r}")

    @property
    def round_interval_steps(self) -> int:
        """Learner steps between two consecutive rounds (of consecutive fragments)."""
        return self.sync_period // self.num_fragments


@config_section
class LearnersConfig:
    """The M learners: names, regions and relative speeds."""

    num_learners: integer_at_least(1, MAX_LEARNERS) = 4
    """M"""
    names: tuple[SafeName, ...] = ()
    """default: learner-0 .. learner-{M-1}"""
    regions: tuple[SafeName, ...] = ()
    """default: "local" for every learner"""
    speeds: tuple[PositiveNumber, ...] = ()
    """relative step rate (1.0 = nominal, 0.5 = half as fast)"""
    batch_sizes: tuple[Size, ...] = ()
    """Sequences per inner step, per learner (default: data.batch_size for every learner). Unequal
    batches model learners on hardware of different sizes; the merge weights tokens^2/steps then
    favour the learners that processed more tokens per step."""
    sharding: one_of("replicated", "fsdp") = "replicated"
    """How a learner holds its state across the devices of its slice (`diloco_core/spmd.py`):
    "replicated" (a full copy per device) or "fsdp" (each array split across the devices: ~1/N of
    the params and AdamW state per device, for models that do not fit replicated)."""
    warm_start_fraction: Fraction = 0.0
    """Share of the token budget trained data-parallel (one lock-step AdamW step on all the
    learners' batches together) before the learners fork from its parameters and AdamW state; 0:
    the learners start apart from the first step. Reference simulator only for now."""
    standby: Count = 0
    """Orchestrated runs: the last `standby` learners of the roster start without capacity (not
    launched); `diloco capacity --join`, the `capacity` job or a fault tape's learner_join brings
    them in while the run goes on (scavenged capacity), and --leave releases any learner. Each
    keeps its own data shard, so data stays disjoint as the learner set changes. The simulator's
    counterpart is simulation.capacity."""

    def __post_init__(self):
        require(self.standby < self.num_learners, "standby",
                f"must be an integer in [0, num_learners - 1 = {self.num_learners - 1}], got "
                f"{self.standby!r}")
        for name in ("names", "regions", "speeds", "batch_sizes"):
            value = getattr(self, name)
            require(len(value) in (0, self.num_learners), name,
                    f"has {len(value)} entries but num_learners is {self.num_learners}")
        require(len(set(self.names)) == len(self.names), "names", "must be unique")

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


@config_section
class Outage:
    """A learner is down (process gone, contributes nothing) from `start` to `end` seconds."""

    learner: Count
    """The learner's index in the roster."""
    start: number_at_least(0)
    """Seconds from the start of the run."""
    end: Number
    """Seconds from the start of the run, after `start`."""

    def __post_init__(self):
        require(self.end > self.start, "end",
                f"must be after start ({self.start}), got {self.end!r}")


@config_section
class Capacity:
    """Compute that is part of the run only for a while (scavenged capacity): learner `learner`
    joins at `join` and leaves at `leave`, as fractions of the run's nominal length (the time a
    speed-1.0 learner takes for the run's steps, `ExperimentConfig.nominal_run_seconds`)."""

    learner: Count
    """The learner's index in the roster."""
    join: Fraction
    """When it joins, as a fraction of the run's nominal length, in [0, 1)."""
    leave: Number = 1.0
    """When it leaves, as a fraction of the run's nominal length, after `join` and at most 1."""

    def __post_init__(self):
        require(self.join < self.leave <= 1, "leave",
                f"must be after join ({self.join}) and at most 1, got {self.leave!r}")

    @property
    def presence(self) -> float:
        return self.leave - self.join


@config_section
class SimulationConfig:
    """The reference simulator's fake clock: step times, sync latency and the failure schedule."""

    step_seconds: PositiveNumber = 1.0
    """nominal inner-step time of a speed-1.0 learner"""
    step_jitter: Fraction = 0.0
    """relative std-dev of each step time (e.g. 0.1 = 10%)"""
    sync_seconds: number_at_least(0) = 0.3
    """merge + transfer latency from decision to delivery"""
    outages: tuple[Outage, ...] = ()
    """learner outages: {learner, start, end} seconds"""
    capacity: tuple[Capacity, ...] = ()
    """Scavenged capacity: learners present only from `join` to `leave` (fractions of the run),
    {learner, join, leave}; a joining learner starts from the global parameters and a peer's
    AdamW state, a leaving one is gone for good. Learners not listed are there throughout."""
    capacity_start_seconds: number_at_least(0) = 0.0
    """Scavenged capacity's start-up under the DiLoCos: a joining learner's first step comes
    this long after its capacity arrives (launch, restore, compile); the capacity is paid for
    but idle meanwhile."""
    capacity_allreduce_seconds: number_at_least(0) = 0.0
    """Data-parallel only: what each step spends all-reducing the whole model's gradients
    across sites while scavenged capacity in another site is part of its batch (the bandwidth
    planner's data-parallel transfer over the inter-site link; 0 = the capacity is in the
    same site). The step waits for it: nothing overlaps."""
    capacity_restart_seconds: number_at_least(0) = 0.0
    """Data-parallel only: a join or a leave of scavenged capacity restarts the whole job to
    re-shard its global batch (relaunch, restore, compile); every chip waits meanwhile."""
    eval_points: PositiveInteger = 8
    """held-out evals of the global params, evenly over the budget"""
    eval_batches: PositiveInteger = 4
    """held-out batches per eval"""



@config_section
class OrchestrationConfig:
    """How the orchestrated run (learner processes + Dagster sensors) paces and heals itself.

    These are wall-clock settings of the real system; the reference simulator ignores them.
    """

    heartbeat_seconds: PositiveNumber = 2.0
    """how often a learner publishes its progress"""
    poll_seconds: PositiveNumber = 0.5
    """how often a learner looks for open rounds / merges"""
    checkpoint_every_steps: PositiveInteger = 50
    """learner Orbax checkpoints (params, AdamW, data position)"""
    async_checkpoints: Flag = True
    """Checkpoints written in the background (Orbax async) while the learner trains on; only a
    finished one is reported. False: every save blocks the loop until durable. A learner that
    spans several processes always blocks (its arrays are not all on one host)."""
    learner_timeout_seconds: PositiveNumber = 60.0
    """heartbeat older than this: the learner counts as down"""
    compile_timeout_seconds: PositiveNumber = 1800.0
    """A learner process's first inner step compiles the step program (minutes for a large model on
    a TPU slice); it keeps heartbeating through it for at most this long."""
    restart_backoff_seconds: PositiveNumber = 5.0
    """first relaunch delay; doubles per consecutive failure"""
    restart_backoff_max_seconds: PositiveNumber = 60.0
    """cap of the relaunch delay"""
    max_restarts: Count = 20
    """Launches of one learner (or of the syncer) within restart_window_seconds; past it the
    supervisor waits for the oldest to leave the window. Per window, so that a week of
    preemptions never exhausts it while a crash loop is still held to this rate."""
    restart_window_seconds: PositiveNumber = 3600.0
    """the window max_restarts counts launches in"""
    rejoin_max_versions_behind: Count = 2
    """own checkpoint is fresh if no fragment is further behind"""
    round_timeout_seconds: PositiveNumber = 300.0
    """a final round stops waiting for silent learners"""
    eval_batches: PositiveInteger = 4
    """held-out batches per round eval"""
    step_seconds_floor: number_at_least(0) = 0.0
    """Emulated hardware: pad each inner step to at least step_seconds_floor / speed seconds (0:
    steps take what the machine takes; slower learners sleep (1/speed - 1) x that)."""
    syncer: one_of(*SYNCER_MODES) = "service"
    """Who decides and merges rounds. "service": one long-lived syncer process per experiment
    (dispatched and supervised by Dagster like a learner, fenced by a lease in the store) polls
    the store every syncer_poll_seconds and merges within a second; the quorum sensor only
    mirrors its records into Dagster, and takes over (one merge run per round) while the syncer's
    lease has not changed for syncer_timeout_seconds. "sensor": the quorum sensor decides every
    round and each merge is a Dagster run (seconds per round)."""
    syncer_poll_seconds: PositiveNumber = 0.25
    """0.25 s: a decision waits at most that for the poll that sees its last offer; polling faster
    cost the 2-core demo's learners a measurable share of a core."""
    syncer_timeout_seconds: PositiveNumber = 20.0
    """lease unchanged this long: the sensor takes over"""
    eval_every_rounds: Count = 0
    """The syncer evaluates the global model after every this many merged rounds (0: once per outer
    step, i.e. every P rounds); the sensor-run merges evaluate every round."""
    rounds_per_partition: Count = 0
    """Rounds per Dagster partition of the round assets (0: automatic). Dagster advises at most
    ~100,000 partitions per asset, and at the paper's cadence (a fragment round every step) a
    month-long run makes millions of rounds: automatic keeps one partition per round while the
    run's expected rounds fit in ROUND_PARTITIONS_MAX, and otherwise groups whole outer steps
    (multiples of P rounds) so that they do. With several rounds a partition, the syncer
    service's mirror records one digest per asset and partition (the database grows by the
    partition, not the round); every round's detail stays in the store."""
    keep_global_versions: Count = 16
    """Retention, applied by the syncer service after its merges: the arrays of global versions
    older than the newest keep_global_versions of their fragment, and of the contributions to
    rounds more than keep_contribution_rounds rounds old, are deleted. Manifests and records stay
    readable (the token ledger and the run summary read them), packed 64 rounds or versions to an
    object once pruned; version 0 and the current version stay whole. A merge refuses a
    contribution whose base version was deleted, so keep_global_versions also bounds the
    staleness a merge accepts. 0: keep everything. newest versions per fragment whose arrays stay"""
    keep_contribution_rounds: Count = 64
    """newest rounds whose contributions' arrays stay"""
    tensorboard_dir: text(lambda v: len(v) <= 1024, "must be a path (or empty)") = ""
    """A directory for TensorBoard event files of the per-round figures and evals (written by the
    syncer and the merge runs, one subdirectory per experiment); empty: none."""
    compilation_cache_dir: text(lambda v: len(v) <= 1024 and "://" not in v,
                                "must be a local directory (or empty)") = "~/.cache/diloco/jax"
    """A directory on each host where the learners and the syncer keep XLA's compiled programs
    (JAX's persistent compilation cache), so that a relaunched process (a preemption, a kill, the
    next run) skips recompiling its step. Keyed by the program itself, so it never serves stale
    code. A local path, never the store: a compiled program is code, and a party that may write
    the store must not choose what another process executes. Empty: off."""
    chaos: Flag = False
    """A chaos run: the experiment's fault tape (faults/tape.json) is injected into its learners,
    merges, syncer and capacity. Set by the chaos tooling (`diloco demo --fault-tape`, the chaos
    soaks, the test harness); the train job refuses a fault tape without it. Off: a tape in the
    store is ignored, with a logged reason."""

    def __post_init__(self):
        # The current version and the one before it: a learner's offer is based on one of them
        # unless it is slower than a whole round of its fragment.
        require(self.keep_global_versions != 1, "keep_global_versions",
                "must be 0 (keep all) or >= 2 (the current version and the one before)")
        # The syncer renews its lease every second: a shorter timeout would mistake a slow
        # store write for a dead syncer.
        require(self.syncer_timeout_seconds >= 3.0, "syncer_timeout_seconds",
                f"must be >= 3 (the lease is renewed every second), got "
                f"{self.syncer_timeout_seconds}")
        require(self.learner_timeout_seconds > self.heartbeat_seconds, "learner_timeout_seconds",
                f"must exceed heartbeat_seconds ({self.heartbeat_seconds}), "
                f"got {self.learner_timeout_seconds}")

def _default_model() -> ModelConfig:
    return ModelConfig.from_preset("small")


@config_section
class ExperimentConfig:
    """Everything one training run needs. Each section checks its own fields; the checks
    across sections live here."""

    name: text(lambda v: SAFE_NAME.fullmatch(v) is not None,
               "must match [a-z0-9][a-z0-9_-]{0,62} (it names storage prefixes)") = "diloco-demo"
    """names the experiment's storage prefix"""
    seed: Count = 0
    """model init, data order and simulated jitter"""
    task: one_of(*TASK_FAMILIES) = "text"
    """The task. "text": next-byte prediction on the corpus (decoder family). "digits":
    classification of scikit-learn's 8x8 handwritten digits (vit family); there a "token" is one
    image, so token_budget, batch sizes and the merge weights count images."""
    token_budget: integer_at_least(1, MAX_TOKEN_BUDGET) = 1_000_000
    """tokens processed by all learners together"""
    model: ModelConfig = field(default_factory=_default_model)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptConfig = field(default_factory=InnerOptConfig)
    outer: OuterOptConfig = field(default_factory=OuterOptConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    learners: LearnersConfig = field(default_factory=LearnersConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)

    def __post_init__(self):
        family = TASK_FAMILIES[self.task]
        require(self.model.family == family, "model.family",
                f"task {self.task!r} needs a {family!r} model (e.g. preset "
                f"{'vit-digits' if family == 'vit' else 'small'!r}), got {self.model.family!r}")
        m = self.learners.num_learners
        require(self.sync.min_quorum <= m, "sync.min_quorum",
                f"must be <= learners.num_learners ({m}), got {self.sync.min_quorum}")
        require(self.sync.min_quorum <= m - self.learners.standby, "learners.standby",
                f"leaves {m - self.learners.standby} learners at the start, fewer than "
                f"sync.min_quorum ({self.sync.min_quorum}): no round could merge")
        if self.task == "text":
            require(self.data.seq_len <= self.model.max_seq_len, "data.seq_len",
                    f"must be <= model.max_seq_len ({self.model.max_seq_len}), "
                    f"got {self.data.seq_len}")
        else:
            p = self.model.patch_size
            require(DIGITS_IMAGE_SIDE % p == 0, "model.patch_size",
                    f"must divide the {DIGITS_IMAGE_SIDE}x{DIGITS_IMAGE_SIDE} digit images, "
                    f"got {p}")
            patches = (DIGITS_IMAGE_SIDE // p) ** 2
            require(patches <= self.model.max_seq_len, "model.max_seq_len",
                    f"must be >= the {patches} patches of an image, got "
                    f"{self.model.max_seq_len}")
        require(not (self.learners.warm_start_fraction and self.simulation.outages),
                "learners.warm_start_fraction",
                "cannot be combined with simulation.outages (the data-parallel phase does not "
                "model failures)")
        listed = [c.learner for c in self.simulation.capacity]
        for i, c in enumerate(self.simulation.capacity):
            require(c.learner < m, f"simulation.capacity[{i}].learner",
                    f"must be < learners.num_learners ({m}), got {c.learner}")
            require(c.learner not in listed[:i], f"simulation.capacity[{i}].learner",
                    f"learner {c.learner} is listed more than once")
        if self.simulation.capacity:
            require(not self.simulation.outages and not self.learners.warm_start_fraction,
                    "simulation.capacity", "cannot be combined with simulation.outages or "
                    "learners.warm_start_fraction")
            at_start = m - sum(1 for c in self.simulation.capacity if c.join > 0)
            require(self.sync.min_quorum <= at_start, "sync.min_quorum",
                    f"must be <= the {at_start} learners present from the start "
                    "(simulation.capacity)")
        last_end: dict[int, float] = {}
        for i, outage in sorted(enumerate(self.simulation.outages), key=lambda x: x[1].start):
            require(outage.learner < m, f"simulation.outages[{i}].learner",
                    f"must be < learners.num_learners ({m}), got {outage.learner}")
            require(outage.start >= last_end.get(outage.learner, -1.0),
                    f"simulation.outages[{i}].start",
                    f"overlaps an earlier outage of learner {outage.learner} "
                    f"(ending at {last_end.get(outage.learner)}); merge them into one")
            last_end[outage.learner] = outage.end
        smallest = min(self.learner_step_tokens)
        require(smallest <= self.token_budget, "token_budget",
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
