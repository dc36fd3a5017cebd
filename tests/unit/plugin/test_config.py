from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_elastic.collective import Backend
from hpc_elastic.env import Environment
from hpc_elastic.launch.spec import JobMarker, MarkerUnit
from hpc_elastic.policy import DEFAULT_MIN_HISTORY, TiresiasGittins
from hpc_elastic.policy.placement import DEFAULT_PACK_LIMIT
from slurm_plugin.cli import main, profile_skew
from slurm_plugin.config import ConfigError, OrderField, load_config, parse_config
from slurm_plugin.daemon import build_policy

REPO = Path(__file__).resolve().parents[3]


def test_shipped_config_is_valid_apart_from_its_state_dir(tmp_path: Path) -> None:
    text = (REPO / "site-config" / "hpc-elastic.toml").read_text().replace("/var/lib/hpc-elastic", str(tmp_path))
    path = tmp_path / "c.toml"
    path.write_text(text)
    config = load_config(path)
    assert config.policy == "tiresias-las" and config.order.field is OrderField.SITE_FACTOR
    assert config.tiresias.thresholds == (3200.0,) and math.isinf(config.tiresias.promote_knob)
    assert config.metrics.address == "127.0.0.1"


def test_every_problem_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        'state_dir = "/nonexistent/hpc-elastic"\nbogus = 1\npolicy = "sjf"\n'
        '[tiresias]\nthresholds = [100.0, 50.0]\n[metrics]\naddress = "0.0.0.0"\n[preemption]\ngrace_s = -1\n'
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    problems = err.value.problems
    assert len(problems) == 6 and all("\n" not in p for p in problems)
    text = "\n".join(problems)
    assert "unknown key 'bogus'" in text
    assert "tiresias.thresholds" in text and "strictly increasing" in text
    assert "unknown policy 'sjf'" in text
    assert "metrics.address" in text and "loopback" in text
    assert "preemption.grace_s" in text
    assert "state_dir: directory '/nonexistent/hpc-elastic' does not exist" in text


@pytest.mark.parametrize("policy", ["easyscale-homo", "easyscale-heter"])
def test_a_policy_planning_gpus_per_type_is_refused_by_the_daemon(policy: str) -> None:
    # the simulator runs it; the daemon keeps each job on one type, and runs EasyScale as tiresias-las+easyscale
    with pytest.raises(ConfigError, match=f"policy '{policy}' plans a job's GPUs on several types at once") as err:
        parse_config({"state_dir": "/tmp", "policy": policy})
    assert "tiresias-las+easyscale" in str(err.value)
    for accepted in ("tiresias-las+elastic", "tiresias-las+easyscale"):
        assert parse_config({"state_dir": "/tmp", "policy": accepted}).policy == accepted


def test_missing_state_dir_key_and_relative_paths() -> None:
    with pytest.raises(ConfigError, match="missing required key 'state_dir'"):
        parse_config({})
    with pytest.raises(ConfigError, match="state_dir must be an absolute path"):
        parse_config({"state_dir": "relative"})
    with pytest.raises(ConfigError, match="ckpt_roots must be absolute"):
        parse_config({"state_dir": "/tmp", "ckpt_roots": ["jobs"]})


@pytest.mark.parametrize(
    ("override", "where"),
    [
        ({"interval_s": float("inf")}, "interval_s"),
        ({"history_refresh_s": float("inf")}, "history_refresh_s"),
        ({"history_window_days": 1e300}, "history_window_days"),  # would overflow the sacct window's date later
        ({"ckpt_roots": []}, "ckpt_roots"),
        ({"preemption": {"min_run_time_s": float("inf")}}, "preemption.min_run_time_s"),
        ({"preemption": {"requeue_wait_s": float("nan")}}, "preemption.requeue_wait_s"),
        ({"tiresias": {"pack_limit": -0.5}}, "tiresias.pack_limit"),
        ({"tiresias": {"refit_tolerance": 0.9}}, "tiresias.refit_tolerance"),
        ({"tiresias": {"refit_pack_limit": "sometimes"}}, "tiresias.refit_pack_limit"),
        ({"tiresias": {"promote_knob": float("nan")}}, "tiresias.promote_knob"),
        ({"tiresias": {"starve_limit_s": 0}}, "tiresias.starve_limit_s"),
        ({"tiresias": {"starve_limit_s": "1h"}}, "tiresias.starve_limit_s: must be a number"),
        # no coercion: a string or a boolean where a flag or a number belongs is a mistake, not a value
        ({"manage_all": "yes"}, "manage_all: must be true or false"),
        ({"interval_s": "10"}, "interval_s: must be a number"),
        ({"max_consecutive_errors": True}, "max_consecutive_errors: must be a number"),
        ({"placement": {"pin_nodes": "y"}}, "placement.pin_nodes: must be true or false"),
        # a signal the job cannot catch would end or freeze it without its checkpoint
        ({"preemption": {"signal": "KILL"}}, "preemption.signal: signal must be one of"),
        ({"preemption": {"signal": "STOP"}}, "preemption.signal"),
        ({"preemption": {"signal": "FOO"}}, "preemption.signal"),
    ],
)
def test_values_out_of_bounds_are_refused(override: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        parse_config({"state_dir": "/tmp", **override})


def test_infinite_promote_knob_still_means_no_promotion() -> None:
    assert parse_config({"state_dir": "/tmp", "tiresias": {"promote_knob": float("inf")}}).tiresias.promote_knob == (
        float("inf")
    )


def test_starve_limit_reaches_the_policy() -> None:
    """The shipped configuration leaves STARVELIMIT off; a site's value reaches the policy's options."""
    shipped = parse_config({"state_dir": "/tmp"})
    assert math.isinf(shipped.tiresias.starve_limit_s)
    config = parse_config({"state_dir": "/tmp", "tiresias": {"starve_limit_s": 86400}})
    assert build_policy(config).options.starve_limit == 86400.0


def test_cli_exits_2_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f'state_dir = "{tmp_path}"\n[tiresias]\nthresholds = [0.0]\n')
    result = CliRunner().invoke(main, ["--config", str(path), "--once", "--dry-run"])
    assert result.exit_code == 2
    assert "tiresias.thresholds: queue thresholds must be finite, > 0" in result.output
    path.write_text(f'state_dir = "{tmp_path}"\ninterval_s = 0\n[metrics]\nport = 70000\n')  # two problems, one line
    result = CliRunner().invoke(main, ["--config", str(path), "--once", "--dry-run"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"hpc-elastic-sched: {path}: ") and "; " in result.stderr
    assert "interval_s" in result.stderr and "metrics.port" in result.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("state_dir = \n")
    result = CliRunner().invoke(main, ["--config", str(broken)])
    assert result.exit_code == 2 and "not valid TOML" in result.output
    deep = tmp_path / "deep.toml"
    deep.write_text(f'state_dir = "{tmp_path}"\nx = {"[" * 5000}{"]" * 5000}\n')
    result = CliRunner().invoke(main, ["--config", str(deep)])
    assert result.exit_code == 2 and result.stderr == f"hpc-elastic-sched: {deep}: not valid TOML: nested too deeply\n"
    undecodable = tmp_path / "latin1.toml"
    undecodable.write_bytes(f'state_dir = "{tmp_path}"\n# caf\xe9\n'.encode("latin-1"))
    result = CliRunner().invoke(main, ["--config", str(undecodable)])
    assert result.exit_code == 2 and "latin1.toml: not UTF-8 text (byte" in result.output
    good = tmp_path / "good.toml"
    good.write_text(f'state_dir = "{tmp_path}"\n')
    result = CliRunner().invoke(main, ["--config", str(good), "--once"], env={"HPC_ELASTIC_SLURM_TIMEOUT": "abc"})
    assert result.exit_code == 2 and "HPC_ELASTIC_SLURM_TIMEOUT" in result.output and result.exception is not None
    no_slurm = {"PATH": str(tmp_path / "no-bin"), "HPC_ELASTIC_SLURM_BACKEND": "auto"}  # no scontrol to ask
    result = CliRunner().invoke(main, ["--config", str(good), "--once"], env=no_slurm)
    assert result.exit_code == 2 and result.stderr.startswith("hpc-elastic-sched: scontrol not found"), result.output
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "state.sqlite3").exists()  # nothing opened
    (tmp_path / "state.sqlite3").mkdir()
    result = CliRunner().invoke(main, ["--config", str(good), "--once"])
    assert result.exit_code == 2 and "unable to open database file" in result.output


def test_skew_comes_from_the_profiles_largest_tensor_share() -> None:
    """S_J is on PACKLIMIT's scale (Tiresias Table 6): the shipped vgg_like profile is skewed, resnet_like not."""
    lookup = profile_skew(Environment())

    def marker(profile: str | None) -> JobMarker:
        return JobMarker(workers=4, min=4, max=4, unit=MarkerUnit.GPU, backend=Backend.TORCH, profile=profile)

    vgg, resnet = lookup(marker("vgg_like@cpu-amd-epyc"), 4), lookup(marker("resnet_like@cpu-amd-epyc"), 4)
    assert vgg is not None and resnet is not None
    assert resnet < DEFAULT_PACK_LIMIT < vgg < 1.0
    assert lookup(marker("no_such_model"), 4) is None and lookup(marker(None), 4) is None
    assert lookup(marker("vgg_like"), 4) is None  # a model name is not a profile name: no search for the scheduler


def test_elastic_policy_and_gittins_history_threshold(tmp_path: Path) -> None:
    """The registry's elastic policy is a valid daemon policy; 2D-Gittins waits for min_history job sizes."""

    config = parse_config({"state_dir": str(tmp_path), "policy": "tiresias-las+elastic"})
    assert build_policy(config).name == "tiresias-las+elastic"
    gittins = parse_config({"state_dir": str(tmp_path), "policy": "tiresias-gittins", "tiresias": {"min_history": 5}})
    assert config.tiresias.min_history == DEFAULT_MIN_HISTORY and gittins.tiresias.min_history == 5
    sizes = [100.0, 900.0, 4000.0, 20000.0]
    few, enough = build_policy(gittins).with_history(sizes), build_policy(gittins).with_history([*sizes, 50.0])
    assert isinstance(few, TiresiasGittins) and isinstance(enough, TiresiasGittins)
    assert len(few.distribution) == 0 and len(enough.distribution) == 5  # 4 < 5 sizes: 2D-LAS
    with pytest.raises(ConfigError, match="tiresias.min_history"):
        parse_config({"state_dir": str(tmp_path), "tiresias": {"min_history": -1}})
