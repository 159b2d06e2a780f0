"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd started in a
temporary directory, on free ports, and stopped again.

    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    with LocalSlurm(tmp_path) as cluster:
        job_id = cluster.sbatch(["--array=0-1", "--wrap", "echo $SLURM_ARRAY_TASK_ID"], cwd=tmp_path)
        states = cluster.wait(job_id, timeout=30)   # {"12_0": "COMPLETED", "12_1": "COMPLETED"}

Clients reach the cluster through `cluster.env` (SLURM_CONF; the munge socket is named in
slurm.conf by AuthInfo=socket=..., which both the daemons and the clients read), e.g.
`subprocess.run(["sbatch", ...], env={**os.environ, **cluster.env})`; `cluster.client_env()`
also drops SLURM_*/SBATCH_*/... variables inherited from an enclosing Slurm job.

Written for Debian's Slurm 22.05 (slurm-wlm) and munge 0.5; needs root (SlurmUser=root).
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import apt_packages
from apt_packages import which

REQUIRED_PROGRAMS = ("sbatch", "slurmctld", "slurmd", "munged")
PACKAGES = ("slurm-wlm", "munge")
_REAPER = Path(__file__).with_name("_reaper.py")

# Job states after which a job (or array task) will not run again on its own.
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
})

# Environment variables of an enclosing Slurm job (or user defaults) that would change what
# the clients do; they are dropped from client_env().
_CLIENT_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SQUEUE_", "SINFO_", "SCONTROL_", "SCANCEL_",
                        "SRUN_", "SALLOC_", "SACCT_")


INSTALL_SWITCH = "BATCHINFER_INSTALL_SLURM"


def ensure_installed(timeout: float = 600.0) -> str | None:
    """None when sbatch, slurmctld, slurmd and munged are available (installing Debian's
    slurm-wlm and munge where the tests may); otherwise a one-line reason, for pytest.skip."""
    return apt_packages.ensure_installed("Slurm", REQUIRED_PROGRAMS, PACKAGES,
                                         INSTALL_SWITCH, timeout)


def _free_port() -> int:
    """A port nothing listens on, below the ephemeral range (32768+) that the daemons'
    and clients' own connections use, so that none of those can take it meanwhile."""
    for _ in range(100):
        port = random.randrange(10000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"--- {path}: (missing)"
    return f"--- {path} (last {lines} lines):\n" + "\n".join(text.splitlines()[-lines:])


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One line of `scontrol show ... -o` as a dict. Values may contain spaces (Command=,
    WorkDir=): a new field starts only where a space is followed by Key=."""
    record = {}
    for field in re.split(r" (?=[A-Za-z][A-Za-z0-9_:/]*=)", line.strip()):
        key, sep, value = field.partition("=")
        if sep:
            record[key] = value
    return record


class SlurmError(RuntimeError):
    pass


class LocalSlurm:
    """A single-node Slurm cluster in `workdir`: start() / stop(), or use it as a context
    manager. The node is this machine (`hostname -s`, at 127.0.0.1), with the CPUs and
    memory `slurmd -C` reports, in one default partition "debug"."""

    def __init__(self, workdir: str | os.PathLike, *, start_timeout: float = 60.0,
                 min_job_age: int = 300, cred_expire: int = 10,
                 cluster_name: str = "batchinfer-test") -> None:
        self.workdir = Path(workdir).resolve()
        self.start_timeout = start_timeout
        self.min_job_age = min_job_age  # seconds slurmctld still shows a finished job
        self.cred_expire = cred_expire  # also the least time a requeued job waits to start
        self.cluster_name = cluster_name
        self.conf_path = self.workdir / "etc" / "slurm.conf"
        self.log_dir = self.workdir / "log"
        self.node_name: str | None = None
        self.partition = "debug"
        self.munge_socket: Path | None = None
        self._socket_dir: str | None = None  # a short mkdtemp when workdir is too long
        self._procs: dict[str, subprocess.Popen] = {}
        self._started = False
        self._stopped = False

    # ----------------------------------------------------------------- environment
    @property
    def env(self) -> dict[str, str]:
        """Variables the Slurm clients need to reach this cluster."""
        return {"SLURM_CONF": str(self.conf_path)}

    def client_env(self) -> dict[str, str]:
        """os.environ without an enclosing job's Slurm variables, plus `env`."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
        return {**base, **self.env}

    def run(self, args: list[str], *, check: bool = True, timeout: float = 30.0,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client (sbatch, squeue, scontrol, ...) against this cluster."""
        program = which(args[0]) or args[0]
        result = subprocess.run([program, *args[1:]], env=self.client_env(), cwd=cwd,
                                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited with {result.returncode}: "
                             f"{result.stderr.strip() or result.stdout.strip()}")
        return result

    # ----------------------------------------------------------------- start / stop
    def __enter__(self) -> "LocalSlurm":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> "LocalSlurm":
        if self._started:
            raise SlurmError("LocalSlurm.start() called twice")
        self._started = True
        missing = [p for p in REQUIRED_PROGRAMS if which(p) is None]
        if missing:
            raise SlurmError(f"Slurm not installed (missing {', '.join(missing)}); "
                             "call ensure_installed() first")
        try:
            self._write_config()
            self._start_munged()
            self._start_daemon("slurmctld", [which("slurmctld"), "-D", "-f", str(self.conf_path)])
            self._start_daemon("slurmd", [which("slurmd"), "-D", "-f", str(self.conf_path),
                                          "-N", self.node_name])
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _node_line(self) -> str:
        result = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True,
                                timeout=30, env={**os.environ, "SLURM_CONF": "/nonexistent"})
        for line in result.stdout.splitlines():
            if line.startswith("NodeName="):
                return line.strip()
        raise SlurmError(f"slurmd -C printed no NodeName= line: {result.stdout}{result.stderr}")

    def _write_config(self) -> None:
        state, spool, run_dir = (self.workdir / "state", self.workdir / "spool",
                                 self.workdir / "run")
        for directory in (self.conf_path.parent, self.log_dir, state, spool, run_dir):
            directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        munge_dir = self.workdir / "munge"
        if len(str(munge_dir / "munge.socket.2.lock")) > 100:  # sun_path is 108 bytes
            self._socket_dir = tempfile.mkdtemp(prefix="munge-")
            munge_dir = Path(self._socket_dir)
        munge_dir.mkdir(parents=True, exist_ok=True)
        munge_dir.chmod(0o755)  # munged wants its socket reachable by all users
        self.munge_socket = munge_dir / "munge.socket.2"

        node_line = self._node_line()
        fields = dict(field.split("=", 1) for field in node_line.split() if "=" in field)
        # The short hostname as Slurm sees it (`hostname -s`): slurmctld only runs where
        # its name matches SlurmctldHost, slurmd is told its NodeName with -N.
        self.node_name = fields["NodeName"]
        # The node line as slurmd -C prints it (CPUs, sockets, cores, threads, RealMemory),
        # so the node registers with exactly the configured resources and is not drained.
        node = " ".join(f"{k}={v}" for k, v in fields.items() if k != "UpTime")
        ctld_port = _free_port()
        while (slurmd_port := _free_port()) == ctld_port:
            pass
        conf = f"""\
# Written by tests/slurm/local_cluster.py
ClusterName={self.cluster_name}
SlurmctldHost={self.node_name}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={run_dir}/slurmctld.pid
SlurmdPidFile={run_dir}/slurmd.pid
SlurmctldLogFile={self.log_dir}/slurmctld.log
SlurmdLogFile={self.log_dir}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=0
ReturnToService=2
MinJobAge={self.min_job_age}
JobRequeue=1
KillWait=2
InactiveLimit=0
MailProg=/bin/true
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName={self.partition} Nodes={self.node_name} Default=YES MaxTime=INFINITE State=UP
"""
        self.conf_path.write_text(conf)

    def _start_munged(self) -> None:
        munge_dir = self.munge_socket.parent
        key = self.workdir / "munge" / "munge.key"
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        self._start_daemon("munged", [
            which("munged"), "--foreground", "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}",
            f"--seed-file={key.parent / 'munged.seed'}",
            f"--log-file={self.log_dir / 'munged.log'}",
        ])
        self._wait_for(lambda: self.munge_socket.exists(), "munged to create its socket",
                       timeout=15)

    def _start_daemon(self, name: str, command: list[str]) -> None:
        output = open(self.log_dir / f"{name}.out", "ab")
        try:
            # Under _reaper.py, which reaps and finally kills what the daemon leaves behind
            # (slurmd double-forks slurmstepd, which setsid()s the job) and stops the daemon
            # if this process dies.
            self._procs[name] = subprocess.Popen(
                [sys.executable, str(_REAPER), *command],
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                env={**self.client_env(), "SLURM_CONF": str(self.conf_path),
                     "_REAPER_PARENT": str(os.getpid())},
                cwd=self.workdir, start_new_session=True)
        finally:
            output.close()

    def _check_daemons(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited with {proc.returncode} during start\n"
                                 + self.log_tails())

    def _wait_for(self, condition, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_daemons()
            if condition():
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout:g}s waiting for {what}\n"
                                 + self.log_tails())
            time.sleep(0.2)

    def node_state(self) -> str | None:
        result = self.run(["sinfo", "-h", "-N", "-n", self.node_name, "-o", "%t"],
                          check=False, timeout=15)
        if result.returncode != 0:
            return None
        return result.stdout.strip() or None

    def _wait_idle(self) -> None:
        self._wait_for(lambda: self.node_state() == "idle", f"node {self.node_name} idle",
                       timeout=self.start_timeout)

    def log_tails(self, lines: int = 25) -> str:
        # In the foreground each daemon logs to stderr (its .out) what it writes to its log
        # file, and before that, the errors that stop it from opening one.
        names = ("munged.out", "slurmctld.out", "slurmd.out")
        return "\n".join(_tail(self.log_dir / name, lines) for name in names
                         if (self.log_dir / name).exists())

    def stop(self) -> None:
        """Cancel the jobs, stop the daemons and whatever they started. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        procs = self._procs
        slurmctld = procs.get("slurmctld")
        if slurmctld is not None and slurmctld.poll() is None:
            # Let slurmd end the running jobs properly first; a moment, not more.
            if self.run(["scancel", "--full", "--quiet", "--user=root"], check=False,
                        timeout=10).returncode == 0:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    result = self.run(["squeue", "-h", "-t", "RUNNING,COMPLETING", "-o", "%i"],
                                      check=False, timeout=10)
                    if result.returncode != 0 or not result.stdout.strip():
                        break
                    time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the reaper passes it on, then cleans up
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()  # the daemon gets SIGKILL too (PR_SET_PDEATHSIG)
                    proc.wait(timeout=10)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def leftover_processes(self) -> list[str]:
        """Live processes (not this one) whose command line or environment names this
        cluster's directory (daemons, slurmstepd, jobs): empty after stop()."""
        marks = [str(self.workdir).encode()]
        if self._socket_dir is not None:
            marks.append(self._socket_dir.encode())
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                if stat[stat.rfind(")") + 2:].startswith("Z"):
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read()
            except OSError:
                continue
            if any(mark in cmdline or mark in environ for mark in marks):
                command = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
                found.append(f"{entry} {command}")
        return found

    # ----------------------------------------------------------------- jobs
    def sbatch(self, args: list[str], cwd: str | os.PathLike | None = None) -> str:
        """Submit with sbatch; returns the job id (for an array, the array's job id)."""
        result = self.run(["sbatch", "--parsable", *args], cwd=cwd)
        job_id = result.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed no job id: {result.stdout!r} {result.stderr!r}")
        return job_id

    def job_records(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job -o JOB_ID` as one dict per line: one per array task once the
        tasks are split off, plus one whose ArrayTaskId is a range (e.g. "0-3") for tasks
        still pending together. Empty once slurmctld has forgotten the job (MinJobAge)."""
        result = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return []
            raise SlurmError(f"scontrol show job {job_id}: {result.stderr.strip()}")
        return [parse_scontrol_record(line) for line in result.stdout.splitlines()
                if line.strip()]

    @staticmethod
    def task_key(record: dict[str, str]) -> str:
        """"ARRAYJOB_TASK" for an array task (as squeue prints it), else the job id."""
        if record.get("ArrayJobId") and record.get("ArrayTaskId") not in (None, "", "N/A"):
            return f"{record['ArrayJobId']}_{record['ArrayTaskId']}"
        return record["JobId"]

    def job_info(self, job_id: str) -> dict[str, dict[str, str]]:
        """The scontrol records of a job or array by task_key()."""
        return {self.task_key(record): record for record in self.job_records(job_id)}

    def states(self, job_id: str) -> dict[str, str]:
        return {key: record.get("JobState", "?") for key, record in self.job_info(job_id).items()}

    def wait(self, job_id: str, timeout: float = 60.0) -> dict[str, str]:
        """Poll until every task of the job has a final JobState; returns {task_key: state},
        e.g. {"7_0": "COMPLETED", "7_1": "FAILED"}. The exit codes are in
        job_info(job_id)[key]["ExitCode"] (e.g. "1:0")."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            states = {key: record.get("JobState", "?") for key, record in info.items()}
            if states and all(state in FINAL_STATES for state in states.values()):
                return states
            if not info:
                raise SlurmError(f"job {job_id} is unknown to slurmctld")
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout:.0f}s waiting for job {job_id}: "
                                 f"{states}\n" + self.log_tails(10))
            self._check_running()
            time.sleep(0.25)

    def _check_running(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited with {proc.returncode}\n" + self.log_tails())

    def requeue(self, job_id: str) -> None:
        """scontrol requeue: the job (all of an array's tasks, or "ARRAY_TASK" for one task)
        runs again, once `cred_expire` seconds (10) have passed: Slurm holds a requeued job
        back (Reason=BeginTime) until the credentials of its last run have expired."""
        self.run(["scontrol", "requeue", str(job_id)])
