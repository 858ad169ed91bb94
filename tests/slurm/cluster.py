"""A real one-node SLURM cluster on this machine, for the tests of jobs/*.sbatch (tests/slurm/test_slurm.py).

    python tests/slurm/cluster.py /tmp/slurm     # bring it up, print the SLURM_CONF to export, Ctrl-C stops it

Steps, each bounded in time; a step that cannot be done raises `Unavailable` naming it, and the
tests skip with that reason:

1. install  Debian's `slurm-wlm`, `munge` and `libpmix-dev` (for `srun --mpi=pmix`) with apt-get,
            root only, those missing only.
2. munge    a key of our own and `munged` on a socket of our own under ROOT (a system munged, if
            any, is left alone).
3. config   ROOT/slurm.conf for one node named after `hostname -s`, with the CPUs and memory that
            `slurmd -C` finds, daemons on free loopback ports, state and spool under ROOT;
            proctrack/linuxproc and task/none, so no cgroups or systemd are needed.
4. daemons  `slurmctld -D` and `slurmd -D` as root, each in a session of its own; up when `sinfo`
            shows the node idle.

Clients reach the cluster through SLURM_CONF=ROOT/slurm.conf (`Cluster.env`). `Cluster.stop`
cancels every job, waits for them to leave, then ends the daemons it started (by process id).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# libpmix-dev: Debian's mpi/pmix plugin loads the unversioned libpmix.so, which only the -dev package
# has; without it `srun --mpi=pmix` fails ("can not load PMIx library")
PACKAGES = ("slurm-wlm", "munge", "libpmix-dev")
DAEMONS = ("munged", "slurmctld", "slurmd")
SBIN_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # where Debian puts the daemons, on PATH or not
MARKER = "MPIASGD_TEST_SLURM"  # environment variable naming the cluster's ROOT in every daemon it starts


class Unavailable(Exception):
    """A step of bringing the cluster up failed; the message names the step and why."""


def run(cmd: list[str], timeout: float, env: dict | None = None, step: str = "") -> subprocess.CompletedProcess:
    """Run `cmd` with a timeout; a timeout or a missing program raises Unavailable naming `step`."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{step}: `{' '.join(cmd)}` did not finish within {timeout:.0f} s") from None
    except OSError as e:
        raise Unavailable(f"{step}: cannot run `{cmd[0]}`: {e}") from None


def missing_packages() -> list[str]:
    """PACKAGES that dpkg does not have installed; without dpkg, [] when the daemons are on PATH."""
    if shutil.which("dpkg-query") is None:
        found = all(shutil.which(d, path=SBIN_PATH) for d in DAEMONS)
        return [] if found else list(PACKAGES)
    res = run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\n", *PACKAGES], 30, step="install")
    installed = {line.split()[0] for line in res.stdout.splitlines() if line.endswith(" installed")}
    return [p for p in PACKAGES if p not in installed]


def install(timeout: float = 240) -> None:
    """apt-get install the PACKAGES missing (no recommends), quietly; refresh the package lists once
    if the first try fails (a fresh machine may have none)."""
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise Unavailable(f"install: {' '.join(missing)} missing and not root (apt-get install {' '.join(missing)})")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"install: {' '.join(missing)} missing and no apt-get on this machine")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    deadline = time.monotonic() + timeout
    apt = ["apt-get", "-qq", "-o", "DPkg::Lock::Timeout=60"]
    res = run([*apt, "install", "-y", "--no-install-recommends", *missing], timeout, env, "install")
    if res.returncode != 0:
        run([*apt, "update"], max(deadline - time.monotonic(), 1), env, "install (apt-get update)")
        res = run([*apt, "install", "-y", "--no-install-recommends", *missing],
                  max(deadline - time.monotonic(), 1), env, "install")
    if res.returncode != 0:
        raise Unavailable(f"install: apt-get install {' '.join(missing)} failed:\n{res.stdout[-2000:]}"
                          f"{res.stderr[-2000:]}")


def install_ahead() -> Future:
    """`install()` started in a background thread; the future's result is None, or the Unavailable it
    raised. A session that will need the cluster starts it at collection (tests/slurm/conftest.py), so
    apt-get downloads and unpacks while the other tiers run; `start` then finds nothing missing."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurm-install")
    try:
        return pool.submit(install)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the install (bounded by its timeout)


INSTALL_AHEAD = pytest.StashKey[Future]()  # the session's install_ahead(), where tests/slurm/conftest.py started one


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line(host: str) -> str:
    """`NodeName=HOST CPUs=.. Boards=.. ... RealMemory=MB` as `slurmd -C` measures this machine."""
    res = run([shutil.which("slurmd", path=SBIN_PATH) or "slurmd", "-C"], 30, step="config (slurmd -C)")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("NodeName=")), None)
    if res.returncode != 0 or line is None:
        raise Unavailable(f"config: `slurmd -C` printed no node line: {res.stdout}{res.stderr}")
    return " ".join([f"NodeName={host}", *line.split()[1:]])


def slurm_conf(root: Path, host: str, node: str, ctld_port: int, slurmd_port: int) -> str:
    """slurm.conf of a one-node cluster: root daemons, linuxproc/none plugins, state under ROOT."""
    return f"""\
# one-node test cluster written by tests/slurm/cluster.py
ClusterName={host.lower()}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups, no systemd: processes tracked by parentage, tasks not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a pass every second: a requeued job starts cred_expire (5 s) after its requeue, not up to a minute later
SchedulerParameters=sched_interval=1,bf_interval=1
MailProg=/bin/true
ReturnToService=2
# short signal-to-kill grace; requeue allowed; finished jobs stay visible to `scontrol show job`
KillWait=2
JobRequeue=1
MinJobAge=3600
InactiveLimit=0
SlurmdTimeout=60
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    root: Path                      # everything of this cluster lives here
    host: str                       # its one node (hostname -s)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # daemon name -> process

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict:
        """This process's environment for the SLURM clients (sbatch, srun, ...): SLURM_CONF points at
        the cluster, and SLURM_* variables of a job this process may run in are dropped."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf)}

    def run(self, cmd: list[str], timeout: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster (`env` added to `self.env`), under a timeout
        (raises subprocess.TimeoutExpired)."""
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**self.env, **(env or {})},
                              stdin=subprocess.DEVNULL)

    def jobs(self, jobid: str) -> list[dict]:
        """`scontrol show job -o JOBID` as one {field: value} per job (an array: one per task); [] when
        the controller no longer knows it. Finished jobs stay known for MinJobAge (an hour here)."""
        res = self.run(["scontrol", "show", "job", "-o", jobid], timeout=10)
        return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in res.stdout.splitlines()
                if line.startswith("JobId=")]

    def logs(self) -> str:
        """The tails of the daemons' logs, for a failure message."""
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {path.name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(out)

    def spawn(self, name: str, cmd: list[str]) -> None:
        """Start daemon `name` in a session of its own, its output in ROOT/log/NAME.out; its
        environment carries MARKER=ROOT, inherited by the slurmstepd processes slurmd forks."""
        cmd = [shutil.which(cmd[0], path=SBIN_PATH) or cmd[0], *cmd[1:]]
        with open(self.root / "log" / f"{name}.out", "w") as log:  # the daemon keeps its own copy open
            try:
                self.procs[name] = subprocess.Popen(cmd, env={**self.env, MARKER: str(self.root)}, stdout=log,
                                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    start_new_session=True)
            except OSError as e:
                raise Unavailable(f"daemons: cannot start {name}: {e}") from None

    def leftovers(self) -> list[int]:
        """Processes still carrying this cluster's MARKER (a slurmstepd that outlived slurmd)."""
        mark, pids = f"{MARKER}={self.root}".encode(), []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if mark in f.read().split(b"\0"):
                            pids.append(int(entry))
                except OSError:
                    continue
        return pids

    def wait_idle(self, timeout: float) -> None:
        """Wait until `sinfo` shows the node idle; raise Unavailable (with the logs) otherwise."""
        deadline, state = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise Unavailable(f"daemons: {name} exited with {proc.returncode}\n{self.logs()}")
            try:
                state = self.run(["sinfo", "-h", "-n", self.host, "-o", "%T"], timeout=10).stdout.strip()
            except subprocess.TimeoutExpired:
                state = "(sinfo timed out)"
            if state == "idle":
                return
            time.sleep(0.3)
        raise Unavailable(f"daemons: node {self.host} not idle within {timeout:.0f} s (sinfo: {state!r})\n"
                          f"{self.logs()}")

    def stop(self, timeout: float = 20) -> None:
        """Cancel every job, wait (bounded) until none is left, then end our daemons, munged last."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                jobs = self.run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.split()
                if jobs:
                    self.run(["scancel", "--full", *jobs], timeout=10)
                deadline = time.monotonic() + timeout
                while jobs and time.monotonic() < deadline:
                    time.sleep(0.5)
                    jobs = self.run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.split()
            except subprocess.TimeoutExpired:
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(root: Path, timeout: float = 60) -> Cluster:
    """Install if needed, then bring up munged, slurmctld and slurmd under ROOT within `timeout`
    seconds (the install has its own bound).

    Raises Unavailable naming the step that failed; the daemons already started are stopped first.
    """
    if sys.platform != "linux":
        raise Unavailable("install: the test cluster needs Linux (Debian's slurm-wlm)")
    install()
    if os.geteuid() != 0:
        raise Unavailable("daemons: slurmd must run as root to start jobs as their user")
    host = socket.gethostname().split(".")[0]
    root = Path(root)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)  # munged refuses a socket directory others may write
    cluster, deadline = Cluster(root, host), time.monotonic() + timeout
    try:
        key = root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o400)
        cluster.spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                                 f"--socket={root}/munge/munge.socket", f"--pid-file={root}/munge/munged.pid",
                                 f"--seed-file={root}/munge/munged.seed", f"--log-file={root}/log/munged.log"])
        while not (root / "munge" / "munge.socket").exists():
            if cluster.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise Unavailable(f"munge: munged did not come up\n{cluster.logs()}")
            time.sleep(0.1)
        cluster.conf.write_text(slurm_conf(root, host, node_line(host), free_port(), free_port()))
        cluster.spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(cluster.conf)])
        cluster.spawn("slurmd", ["slurmd", "-D", "-f", str(cluster.conf)])
        cluster.wait_idle(max(deadline - time.monotonic(), 5))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mpiasgd-slurm").resolve()
    try:
        cluster = start(root)
    except Unavailable as e:
        print(f"no cluster: {e}", file=sys.stderr)
        return 1
    print(f"cluster up: node {cluster.host}\n  export SLURM_CONF={cluster.conf}\nCtrl-C stops it.", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # kill PID stops it like Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
