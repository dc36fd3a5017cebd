"""The daemon's configuration: ``site-config/hpc-elastic.toml``, validated at start.

Every problem is reported on its own line (unknown key, bad threshold, missing state directory, ...); the CLI
prints them and exits 2. Pure except :func:`load_config`, which reads the file and checks the state directory.
"""

from __future__ import annotations

import math
import re
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hpc_elastic.files import read_input
from hpc_elastic.policy import DEFAULT_MIN_HISTORY, DEFAULT_PACK_LIMIT, DEFAULT_THRESHOLDS, POLICY_NAMES
from hpc_elastic.policy.easyscale import DEFAULT_FALLBACK_HOLD
from hpc_elastic.policy.policies import Dl2GpuFallback
from hpc_elastic.policy.registry import DAEMON_POLICY_NAMES
from hpc_elastic.sim.ps_jobs import SLOT_SECONDS

DEFAULT_CKPT_ROOT = "/tmp/hpc-elastic/gpfs/jobs"  # noqa: S108 - the dev cluster's GPFS stand-in
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class OrderField(StrEnum):
    """How the policy's order reaches Slurm: SiteFactor keeps multifactor (age, ...) working; Priority freezes it."""

    SITE_FACTOR = "SiteFactor"
    PRIORITY = "Priority"


class ConfigError(ValueError):
    """One or more problems in the configuration, each in :attr:`problems`; as a message, all on one line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class _Section(BaseModel):
    #: no NaN or infinity anywhere unless a field says so (an infinite wait would never end)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        """A flag must be a TOML boolean and a number a TOML number: ``manage_all = "yes"`` or ``interval_s = "10"``
        is a mistake to name, not a value to convert (pydantic would read them as true and 10.0)."""
        kind = cls.model_fields[info.field_name].annotation if info.field_name else None
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"must be a number, got {value!r}")
        return value


#: the signals ``[preemption] signal`` may name (scancel's names): those a job can catch
CATCHABLE_SIGNALS = frozenset({"USR1", "USR2", "TERM", "INT", "HUP", "URG", "CONT", "QUIT", "ALRM", "WINCH"})

#: the longest any wait or period of the daemon may be (a week): beyond it a value is a typo
WEEK_S = 7 * 24 * 3600.0


class TiresiasConfig(_Section):
    """Discretised 2DAS knobs (Tiresias §3.2.3) and PACKLIMIT (§3.3)."""

    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    promote_knob: float = Field(default=math.inf, allow_inf_nan=True)
    #: STARVELIMIT: a job that has waited this long goes ahead of every other (inf: never; the daemon still never
    #: preempts a job within ``[preemption] min_run_time_s``)
    starve_limit_s: float = Field(default=math.inf, allow_inf_nan=True)
    pack_limit: float = Field(default=DEFAULT_PACK_LIMIT, ge=0)
    #: refit PACKLIMIT from the placements and speeds the jobs report (§3.3.2; ``pack_limit`` stands until the
    #: reports separate two models: :mod:`slurm_plugin.pack_limit`)
    refit_pack_limit: bool = True
    #: a model is placement-sensitive when it ran at least this many times as fast consolidated as spread
    refit_tolerance: float = Field(default=1.1, ge=1, le=100)
    #: 2D-Gittins runs as 2D-LAS until sacct gave it this many job sizes
    min_history: int = Field(default=DEFAULT_MIN_HISTORY, ge=0)

    @field_validator("thresholds")
    @classmethod
    def _increasing(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        previous = 0.0
        for item in value:
            if not (math.isfinite(item) and item > previous):
                raise ValueError(
                    f"queue thresholds must be finite, > 0 and strictly increasing GPU-seconds, got {list(value)!r}"
                )
            previous = item
        return value

    @field_validator("promote_knob")
    @classmethod
    def _knob(cls, value: float) -> float:
        if not value >= 0:  # NaN too
            raise ValueError(f"promote_knob must be >= 0 (inf disables promotion), got {value!r}")
        return value

    @field_validator("starve_limit_s")
    @classmethod
    def _starve(cls, value: float) -> float:
        if not value >= 1:  # NaN too
            raise ValueError(f"starve_limit_s must be >= 1 second (inf: never), got {value!r}")
        return value

    @field_validator("pack_limit")
    @classmethod
    def _pack(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"pack_limit must be finite, got {value!r}")
        return value


class PreemptionConfig(_Section):
    """Checkpointed preemption (Tiresias §3.2.3: preemption is expensive, hence ``min_run_time_s``)."""

    enabled: bool = True
    signal: str = "USR1"
    batch: bool = True
    grace_s: float = Field(default=120.0, gt=0, le=3600)
    min_run_time_s: float = Field(default=300.0, ge=0, le=WEEK_S)
    #: at most this many preemptions per pass (0: none)
    max_per_pass: int = Field(default=4, ge=0, le=10_000)
    requeue_wait_s: float = Field(default=10.0, ge=0, le=3600)

    @field_validator("signal")
    @classmethod
    def _signal(cls, value: str) -> str:
        """A signal a job can catch (the wrapper checkpoints on ``USR1``): never KILL or STOP, which would end or
        freeze the job without its checkpoint."""
        if value not in CATCHABLE_SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(sorted(CATCHABLE_SIGNALS))}, got {value!r}")
        return value


class OrderConfig(_Section):
    field: OrderField = OrderField.SITE_FACTOR
    base: int = Field(default=10_000, ge=0)
    step: int = Field(default=1_000, ge=1)


class PlacementConfig(_Section):
    """Placement constraints for pending managed jobs (Tiresias §3.3)."""

    enabled: bool = True
    pin_nodes: bool = False


class ResizeConfig(_Section):
    """Elastic jobs (``--min-gpus``/``--max-gpus`` at submit) shrink when others wait and grow into idle GPUs,
    by checkpoint -> requeue -> new size (NumTasks) while pending. ``fallback_hold_s``: EasyScale's Role 3 cap
    (§3.4): after a grow observed slower a job falls back and grows no further for this long, doubled for each
    grow in a row observed slower (``tiresias-las+easyscale``)."""

    enabled: bool = False
    fallback_hold_s: float = Field(default=DEFAULT_FALLBACK_HOLD, ge=0, le=WEEK_S)


class Dl2Config(_Section):
    """``policy = "dl2"``: DL²'s trained policy network (a model file of ``hpc-elastic dl2 train``, site-owned: read
    only as a regular file, no link, at most ``model_file.MAX_BYTES``) decides the workers and PS of the running
    ps-mode jobs of CPU partitions once per ``slot_s`` (DL² §3.1's time slot; the model's own slot length, else
    the daemon falls back). GPU jobs: ``tiresias-las``."""

    model: Path | None = None
    slot_s: float = Field(default=SLOT_SECONDS, gt=0, le=WEEK_S)

    @field_validator("model")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"model must be an absolute path, got {str(value)!r}")
        return value


class MetricsConfig(_Section):
    enabled: bool = True
    address: str = "127.0.0.1"
    port: int = Field(default=9810, ge=0, le=65535)

    @field_validator("address")
    @classmethod
    def _loopback(cls, value: str) -> str:
        if value not in LOOPBACK:
            allowed = ", ".join(sorted(LOOPBACK))
            raise ValueError(f"metrics are served on a loopback address only ({allowed}), got {value!r}")
        return value


class PluginConfig(_Section):
    state_dir: Path
    policy: str = "tiresias-las"
    interval_s: float = Field(default=10.0, gt=0, le=3600)
    event_poll_s: float = Field(default=2.0, ge=0, le=3600)
    stop_poll_s: float = Field(default=1.0, gt=0, le=60)
    manage_all: bool = False
    job_name_pattern: str = ""
    ckpt_roots: tuple[Path, ...] = Field(default=(Path(DEFAULT_CKPT_ROOT),), min_length=1)
    history_refresh_s: float = Field(default=3600.0, gt=0, le=WEEK_S)
    history_window_days: float = Field(default=30.0, gt=0, le=3650)
    max_consecutive_errors: int = Field(default=5, ge=1, le=1000)
    tiresias: TiresiasConfig = TiresiasConfig()
    preemption: PreemptionConfig = PreemptionConfig()
    order: OrderConfig = OrderConfig()
    placement: PlacementConfig = PlacementConfig()
    resize: ResizeConfig = ResizeConfig()
    metrics: MetricsConfig = MetricsConfig()
    dl2: Dl2Config = Dl2Config()

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value in POLICY_NAMES and value not in DAEMON_POLICY_NAMES:
            raise ValueError(
                f"policy {value!r} plans a job's GPUs on several types at once, which the daemon cannot apply"
                " (hpc-elastic simulate runs it; the daemon's EasyScale is tiresias-las+easyscale)"
            )
        if value not in DAEMON_POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r}; choose from {', '.join(DAEMON_POLICY_NAMES)}")
        return value

    @field_validator("job_name_pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"job_name_pattern is not a regular expression: {exc}") from None
        return value

    @field_validator("ckpt_roots")
    @classmethod
    def _absolute(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        for path in value:
            if not path.is_absolute():
                raise ValueError(f"ckpt_roots must be absolute paths, got {str(path)!r}")
        return value

    @model_validator(mode="after")
    def _state_dir_absolute(self) -> PluginConfig:
        if not self.state_dir.is_absolute():
            raise ValueError(f"state_dir must be an absolute path, got {str(self.state_dir)!r}")
        return self

    @model_validator(mode="after")
    def _dl2_model(self) -> PluginConfig:
        if self.policy == Dl2GpuFallback.name and self.dl2.model is None:
            raise ValueError('policy "dl2" needs [dl2] model = "<absolute path of the model file>"')
        return self


def _location(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def parse_config(data: dict[str, Any], source: str = "config") -> PluginConfig:
    """Validate a parsed TOML document; raise :class:`ConfigError` with one line per problem."""
    try:
        return PluginConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = _location(tuple(err["loc"]))
            if err["type"] == "extra_forbidden":
                problems.append(f"{source}: unknown key {where!r}")
            elif err["type"] == "missing":
                problems.append(f"{source}: missing required key {where!r}")
            else:
                message = str(err["msg"]).removeprefix("Value error, ")
                problems.append(f"{source}: {where}: {message}")
        raise ConfigError(problems) from None


def load_config(path: Path) -> PluginConfig:
    """Read and validate the TOML file; the state directory must exist and be writable."""
    try:
        data = tomllib.loads(read_input(path).decode("utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte {exc.start})"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML: {exc}"]) from None
    except RecursionError:  # arrays or inline tables nested deeper than the parser goes
        raise ConfigError([f"{path}: not valid TOML: nested too deeply"]) from None
    problems: list[str] = []
    try:
        config = parse_config(data, str(path))
    except ConfigError as exc:
        problems = list(exc.problems)
        config = None
    state = data.get("state_dir")
    if isinstance(state, str) and Path(state).is_absolute() and not Path(state).is_dir():
        problems.append(f"{path}: state_dir: directory {state!r} does not exist (create it, owned by the daemon)")
    if problems or config is None:
        raise ConfigError(problems)
    return config
