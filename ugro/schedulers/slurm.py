"""`ugro slurm-script`: the job as an sbatch script, for a SLURM cluster with a shared filesystem.

The export writes into the run directory (``<runs>/<job-id>/slurm/``): ``job.sbatch`` (what you
submit), ``node.sh`` (what srun starts on every node: torchrun, like the LAN's launch script),
``job.yaml`` (the job file as exported: a requeue trains exactly it), and ``profiles/<name>.yaml``
(every memory profile of the profile map, checked). Code and Python come from the shared
filesystem (``--code-dir``, ``--python``), and the run directory must be on it too: every rank
writes its log there, and the main rank its checkpoints and metrics.
"""

from __future__ import annotations

import datetime
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from train.config import ConfigError, JobConfig, load_job
from ugro.checks import jobcheck, ranks
from ugro.schedulers import profile_map

TEMPLATES = Path(__file__).resolve().parent / "templates"
PORT_BASE, PORT_SPAN = 29500, 1000
# A path SLURM takes in an #SBATCH line (no quoting there) and bash takes unquoted in node.sh's globs.
SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+\Z")
TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S


def seconds(limit: str) -> int:
    """SLURM's time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, secs = [*parts, 0, 0][:3]
    else:
        hours, minutes, secs = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + secs


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int = 2
    gpus_per_node: int = 0
    gpu_type: str = ""
    cpu_procs_per_node: int = 1  # processes per node when the job asks for no GPU
    cpus_per_task: int = 0  # 0: the partition's default
    partition: str = ""
    time_limit: str = ""
    constraint: str = ""
    signal_seconds: int = 300  # SIGUSR1 this long before the time limit: checkpoint, stop, requeue
    port: int = 0  # 0: 29500 + job id % 1000
    ifname: str = ""  # GLOO/NCCL_SOCKET_IFNAME, when hostname resolution picks the wrong interface
    extra: list[str] = field(default_factory=list)  # further #SBATCH options, verbatim

    @property
    def nproc(self) -> int:
        """Ranks per node: one per GPU, or the CPU processes of a job without GPUs."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.cpu_procs_per_node


@dataclass(frozen=True)
class Export:
    run_dir: Path
    script: Path
    node_script: Path
    profiles: list[str]


def _check_options(opts: SlurmOptions) -> None:
    if opts.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, not {opts.nodes}")
    if opts.gpus_per_node < 0 or opts.cpu_procs_per_node < 1 or opts.cpus_per_task < 0:
        raise ConfigError("--gpus-per-node and --cpus-per-task must be >= 0, --cpu-procs-per-node >= 1")
    if not 10 <= opts.signal_seconds <= 65535:
        raise ConfigError(
            f"--signal-seconds {opts.signal_seconds}: between 10 (a step and a checkpoint) and 65535 (SLURM's most)"
        )
    if opts.time_limit and not TIME.match(opts.time_limit):
        raise ConfigError(f"--time {opts.time_limit!r}: SLURM's forms are M, M:S, H:M:S, D-H, D-H:M or D-H:M:S")
    if opts.time_limit and opts.signal_seconds * 2 > seconds(opts.time_limit):
        raise ConfigError(
            f"--signal-seconds {opts.signal_seconds} is more than half of --time {opts.time_limit}: every start would "
            "be warned (and requeued) before it trains much; lower it or raise the time limit"
        )
    if opts.port and not 1024 <= opts.port <= 65535:
        raise ConfigError(f"--port {opts.port}: a port between 1024 and 65535 (0: derived from the job id)")
    for name, value in (("--gpu-type", opts.gpu_type), ("--partition", opts.partition),
                        ("--constraint", opts.constraint), ("--ifname", opts.ifname)):  # fmt: skip
        if value and not re.match(r"^[A-Za-z0-9_.,:&|!*\[\]-]+$", value):
            raise ConfigError(f"{name} {value!r}: letters, digits and SLURM's own punctuation only")
    for option in opts.extra:
        if not option.startswith("--") or "\n" in option:
            raise ConfigError(f"--sbatch-option {option!r}: one long sbatch option such as --account=abc")


def _safe(path: Path, what: str) -> Path:
    if not SAFE_PATH.match(str(path)):
        raise ConfigError(f"{what} {path}: SLURM scripts need a path of letters, digits and ._/+- only")
    return path


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES / "slurm")),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # shell scripts: values are quoted with the q filter
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def job_id_for(job: JobConfig, runs_dir: Path, resume: bool) -> str:
    """A new job id, or with ``resume`` the newest earlier SLURM export of this job."""
    if resume:
        earlier = sorted(p.name for p in runs_dir.glob(f"{job.name}-*") if (p / "slurm" / "job.sbatch").is_file())
        if earlier:
            return earlier[-1]
    return f"{job.name}-{datetime.datetime.now(datetime.UTC).strftime('%Y%m%d-%H%M%S')}"


def export(
    job_file: Path,
    opts: SlurmOptions,
    code_dir: Path,
    python: Path,
    runs_dir: Path,
    map_file: Path,
    job_id: str | None = None,
) -> Export:
    """Check the job, the options and the profile map, then write the scripts into ``runs_dir/<job-id>/slurm``."""
    _check_options(opts)
    job = load_job(job_file)
    jobcheck.check_data(job, code_dir)  # a bad record fails here, naming the file and line, not on a node
    starts = f"--nodes {opts.nodes} with {opts.nproc} process(es) each start {opts.nodes * opts.nproc} ranks"
    problem = ranks.too_few_sequences(job, job_file, opts.nodes * opts.nproc, starts, "--nodes, --gpus-per-node or "
                                      "--cpu-procs-per-node")  # fmt: skip
    if problem:
        raise ConfigError(problem)
    pmap = profile_map.load(map_file, job)
    code_dir, runs_dir = _safe(code_dir.resolve(), "--code-dir"), _safe(runs_dir.resolve(), "--runs-dir")
    python = _safe(python if python.is_absolute() else code_dir / python, "--python")
    job_id = job_id or job_id_for(job, runs_dir, resume=False)
    run_dir = runs_dir / job_id
    slurm_dir = run_dir / "slurm"
    (slurm_dir / "profiles").mkdir(parents=True, exist_ok=True)
    for old in (slurm_dir / "profiles").glob("*.yaml"):
        old.unlink()
    for name in pmap.profiles:
        (slurm_dir / "profiles" / f"{name}.yaml").write_text(profile_map.profile_text(pmap, name))
    shutil.copyfile(job_file, slurm_dir / "job.yaml")

    values = {
        "job_id": job_id,
        "job_name": job.name,
        "job_source": str(job_file),
        "job_file": str(slurm_dir / "job.yaml"),
        "run_dir": str(run_dir),
        "code_dir": str(code_dir),
        "python": str(python),
        "script": str(slurm_dir / "job.sbatch"),
        "node_script": str(slurm_dir / "node.sh"),
        "nproc": opts.nproc,
        "port_base": PORT_BASE,
        "port_span": PORT_SPAN,
        "map_source": pmap.source,
        "default_profile": pmap.default,
        "rules": pmap.match,
        **{k: getattr(opts, k) for k in SlurmOptions.__dataclass_fields__},
    }
    env = _environment()
    script = slurm_dir / "job.sbatch"
    node_script = slurm_dir / "node.sh"
    for path, template in ((script, "job.sbatch.j2"), (node_script, "node.sh.j2")):
        path.write_text(env.get_template(template).render(values))
        path.chmod(0o755)
    return Export(run_dir, script, node_script, list(pmap.profiles))
