"""The trust boundary on the real dev cluster: hpc-elastic-sched as its service account (``slurm``, the shipped
unit's ``User=``), a second Unix user (``hpc-tenant``) as the owner of hostile jobs: forged markers, an
acknowledgement from the future, links planted where the old daemon wrote its stop file."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_elastic.jobdir import StopNotice
from hpc_elastic.slurm import CliSlurm
from tests.integration.conftest import wait_for
from tests.integration.plugin_helpers import MARK, job_of

pytestmark = pytest.mark.integration
SERVICE, TENANT = "slurm", "hpc-tenant"
# takes the USR1 and goes on: it never checkpoints, so only the daemon's grace period can end its hold on the GPUs
STUBBORN = "#!/bin/bash\ntrap '' USR1\nsleep 600\n"


def uid(user: str) -> int:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        pytest.skip(f"no Unix user {user}: scripts/dev-cluster up creates it")


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    argv_as = ["runuser", "-u", user, "--", *argv]
    return subprocess.run(argv_as, check=False, capture_output=True, text=True, timeout=200)


def python_as(user: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Python code run with ``user``'s uid and groups: the interpreter starts as root (this checkout's interpreter
    may live where only root can reach, as pyenv's under /root), imports what it needs, then drops to the user
    for good before it runs ``code``, as a daemon's service manager would start it."""
    boot = (
        "import grp, os, pwd, runpy, sys; import slurm_plugin.cli, hpc_elastic.jobdir; "
        f"pw = pwd.getpwnam({user!r}); "
        "os.setgroups([g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem]); "
        "os.setgid(pw.pw_gid); os.setuid(pw.pw_uid); os.environ['HOME'] = pw.pw_dir; "
        "assert os.getuid() == os.geteuid() == pw.pw_uid; "
        "sys.argv = [sys.argv[0], *sys.argv[1:]]; "
        f"exec({code!r})"
    )
    argv = [sys.executable, "-c", boot, *args]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=200)


def tenant_submit(workdir: Path, name: str, *options: str, job_name: str | None = None) -> int:
    script = workdir / f"{name}.sh"
    script.write_text(STUBBORN)
    script.chmod(0o644)
    logs = workdir / "tenant"  # the tenant's own, for its jobs' output
    logs.mkdir(exist_ok=True)
    os.chown(logs, uid(TENANT), -1)
    out = as_user(TENANT, "sbatch", "--parsable", f"--job-name={job_name or name}", f"--output={logs}/{name}-%j.out",
                  *options, str(script))  # fmt: skip
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def test_the_service_account_preempts_a_hostile_tenants_job_and_writes_nothing_of_theirs(
    slurm: CliSlurm, workdir: Path, submitted: list[int]
) -> None:
    if os.getuid() != 0:
        pytest.skip("switching users needs root")
    service, tenant = uid(SERVICE), uid(TENANT)
    workdir.chmod(0o755)
    roots = workdir / "jobs"
    roots.mkdir(mode=0o1777)
    roots.chmod(0o1777)  # a shared checkpoint root, as on GPFS: every user makes their own job directories
    state = workdir / "state"
    state.mkdir()
    os.chown(state, service, service)
    victim = workdir / "victim"
    victim.write_text("precious\n")
    a100 = ("--partition=gpu-a100", "--nodes=1", "--gres=gpu:a100:4")
    # the tenant's marked job, held until its directory is planted, and an unmarked filler for the other node
    hostile = tenant_submit(workdir, "tr-hostile", *a100, f"--comment={MARK}", "--hold")
    submitted.append(hostile)
    submitted.append(tenant_submit(workdir, "tr-filler", *a100))
    plant = (
        f"import os, json; d = '{roots}/tr-hostile-{hostile}'; os.makedirs(d + '/control', mode=0o755); "
        f"os.chmod(d, 0o711); os.symlink('{victim}', d + '/control/stop'); "
        f"[os.symlink('{victim}', d + f'/control/.stop.{{p}}.tmp') for p in range(300, 400)]; "
        f"open(d + '/control/ack.json', 'w').write(json.dumps({{'job_id': {hostile}, 'restart_count': 0, "
        f"'step': 1, 'checkpoint': '/x', 'written_at': 1e12}}))"
    )
    out = python_as(TENANT, plant)
    assert out.returncode == 0, out.stderr
    slurm.release([hostile])
    wait_for("the tenant's jobs to run", lambda: all(j.state.is_running for j in slurm.jobs(submitted[:2])))
    forged = tenant_submit(
        workdir,
        "tr-forged",
        *a100,
        "--comment=hpc-elastic:v=1,workers=1,min=0,max=1,unit=gpu,backend=torch",
        # byte 0xff (squeue --json passes it through: it once failed every pass), a newline and a | in the name
        job_name="tr-forged\udcff\nname|x",
    )
    submitted.append(forged)  # once made every pass a partial read: no action cluster-wide
    # a begin time past year 9999: squeue's epoch seconds for it once failed the parse of the whole queue
    submitted.append(tenant_submit(workdir, "tr-far", *a100, f"--comment={MARK}", "--begin=now+3000000days"))
    honest = slurm.submit(
        script_text="#!/bin/bash\nsleep 300\n",
        options=["--job-name=tr-honest", *a100, f"--comment={MARK}", f"--output={workdir}/honest-%j.out"],
    )
    submitted.append(honest)
    wait_for("the honest job to wait", lambda: slurm.job(honest).state.is_pending)
    config = workdir / "sched.toml"
    config.write_text(
        f'state_dir = "{state}"\njob_name_pattern = "^tr-"\nckpt_roots = ["{roots}"]\n'
        "[tiresias]\nthresholds = [1.0]\n[preemption]\nmin_run_time_s = 0\ngrace_s = 10\nrequeue_wait_s = 1\n"
        "[metrics]\nenabled = false\n"
    )
    config.chmod(0o644)
    run = python_as(SERVICE, "slurm_plugin.cli.main()", "--config", str(config), "--once")
    assert run.returncode == 0, run.stderr
    assert f"job {forged} left out" in run.stderr and "not a count" in run.stderr
    notice = StopNotice.decode(slurm.job(hostile).admin_comment)
    assert notice is not None  # the stop travelled in Slurm's field, set by the service account
    # the acknowledgement from the future did not count: requeued at the end of the grace period
    wait_for("the hostile job's requeue", lambda: (job_of(slurm, hostile) or slurm.job(hostile)).restart_count == 1)
    assert victim.read_text() == "precious\n"
    for path in [workdir, *workdir.rglob("*")]:
        info = os.lstat(path)
        assert info.st_uid != service or path.is_relative_to(state), f"the daemon wrote {path}"
        if path.is_relative_to(roots / f"tr-hostile-{hostile}"):
            assert info.st_uid == tenant and (stat.S_ISLNK(info.st_mode) or path.name != "stop")
