"""How the peer benchmark measures: the CPU seconds and resident memory of a process tree (every
data worker, Ray actor and Ray's own processes are descendants of the process that started the
local Ray cluster or the DataLoader), sampled in a thread; means with two standard errors from
blocks of consecutive measurements; ratios with errors by the delta method."""
from __future__ import annotations

import math
import os
import threading
import time

import psutil

RAY_SYSTEM = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor", "ray_client_server",
              "runtime_env_agent", "dashboard_agent")


def split_cores(data_cores: int | None) -> tuple[set[int], set[int]]:
    """(the data path's cores, the trainer ranks' cores) out of this process's: the first
    ``data_cores`` for the data path, the rest for the ranks (all of them shared when the budget
    takes every core, or when none is given)."""
    cores = sorted(os.sched_getaffinity(0))
    if not data_cores or data_cores >= len(cores):
        return set(cores), set(cores)
    return set(cores[:data_cores]), set(cores[data_cores:])


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cores`` (an affinity is per thread, and the children
    a thread starts inherit its own)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that has just exited
            pass


def pin_children(pid: int, cores: set[int]) -> int:
    """Every descendant of ``pid`` onto ``cores``; returns how many processes were pinned."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0
    for child in children:
        pin(child.pid, cores)
    return len(children)


def _kind(proc: psutil.Process, root: int, ranks: set[int]) -> str:
    if proc.pid == root:
        return "driver"
    if proc.pid in ranks:
        return "rank"
    try:
        cmd = " ".join(proc.cmdline()[:3])
    except (psutil.Error, OSError):
        cmd = ""
    name = proc.name()
    if any(s in name or s in cmd for s in RAY_SYSTEM) and "ray::" not in name:
        return "ray_system"
    return "data_workers"


class ProcessTreeMeter:
    """CPU seconds (user + system) of ``root`` and all its descendants since ``start``, by kind:
    driver, rank (trainer ranks, named by ``set_ranks``), ray_system (raylet, GCS, agents) and
    data_workers (everything else: DataLoader workers, Ray Data and vlmfeed actors, Ray tasks).
    A process that exits loses at most one sampling interval of its time. Also the peak of the
    tree's summed resident memory."""

    def __init__(self, root: int | None = None, interval_s: float = 0.2):
        self.root = root or os.getpid()
        self.interval_s = interval_s
        self.ranks: set[int] = set()
        self._base: dict[tuple[int, float], float] = {}
        self._last: dict[tuple[int, float], tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_rss_gib = 0.0

    def set_ranks(self, pids) -> None:
        self.ranks = set(int(p) for p in pids)

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.root)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def _sample(self) -> dict[tuple[int, float], tuple[str, float]]:
        seen, rss = {}, 0
        for p in self._tree():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    key = (p.pid, p.create_time())
                    seen[key] = (_kind(p, self.root, self.ranks), t.user + t.system)
                    rss += p.memory_info().rss
            except (psutil.Error, OSError):
                continue
        self.peak_rss_gib = max(self.peak_rss_gib, rss / 2**30)
        return seen

    def start(self) -> "ProcessTreeMeter":
        """Zero: what every live process has used so far does not count."""
        now = self._sample()
        with self._lock:
            self._base = {k: v[1] for k, v in now.items()}
            self._last = dict(now)
        self.peak_rss_gib = 0.0
        self._sample()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="process-tree-meter")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._update()

    def _update(self) -> None:
        now = self._sample()
        with self._lock:
            self._last.update(now)

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds since ``start`` by kind, and their total (sampled now)."""
        self._update()
        out = {"driver": 0.0, "rank": 0.0, "ray_system": 0.0, "data_workers": 0.0}
        with self._lock:
            for key, (kind, cpu) in self._last.items():
                out[kind] += max(0.0, cpu - self._base.get(key, 0.0))
        out["total"] = sum(out.values())
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and its standard error (None where there are too few values)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, None
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return m, math.sqrt(var / len(vals))


def block_means(values: list[float], blocks: int = 5) -> list[float]:
    """Means of ``blocks`` consecutive runs of the values (steps or batches are correlated; block
    means are close to independent, so their spread gives an honest standard error)."""
    vals = [v for v in values if v is not None]
    if len(vals) < blocks:
        return vals
    size = len(vals) // blocks
    return [sum(vals[i * size:(i + 1) * size]) / size for i in range(blocks)]


def ratio(num: tuple, den: tuple) -> dict:
    """num/den with two standard errors (delta method), from (mean, se) pairs."""
    (a, sa), (b, sb) = num, den
    if a is None or b is None or b == 0:
        return {"ratio": None, "pm_2se": None}
    r = a / b
    if sa is None or sb is None or a == 0:
        return {"ratio": round(r, 3), "pm_2se": None}
    return {"ratio": round(r, 3), "pm_2se": round(2 * abs(r) * math.sqrt((sa / a) ** 2 + (sb / b) ** 2), 3)}


class Clock:
    """Wall time and process-tree CPU at block boundaries of a stream of micro-batches."""

    def __init__(self, meter: ProcessTreeMeter):
        self.meter = meter
        self.marks: list[tuple[float, float, int]] = []  # (time, tree CPU, samples so far)

    def mark(self, samples: int) -> None:
        self.marks.append((time.perf_counter(), self.meter.cpu_s()["total"], samples))

    def block_rates(self, blocks: int = 5) -> tuple[tuple, tuple]:
        """(samples/s, CPU-s per sample), each as (estimate, standard error): totals over totals,
        the errors from blocks of consecutive marks by the ratio estimator (batches arrive in
        bursts, and blocks differ in length, so a mean of per-block rates would mislead)."""
        marks = self.marks
        if len(marks) < 2:
            return (None, None), (None, None)
        k = min(blocks, len(marks) - 1)
        edges = [marks[round(i * (len(marks) - 1) / k)] for i in range(k + 1)]
        dt = [b[0] - a[0] for a, b in zip(edges, edges[1:])]
        dc = [b[1] - a[1] for a, b in zip(edges, edges[1:])]
        dn = [b[2] - a[2] for a, b in zip(edges, edges[1:])]
        return ratio_estimate(dn, dt), ratio_estimate(dc, dn)


def block_totals(records: list[dict], blocks: int = 5) -> dict:
    """Tokens and seconds of the steps in ``blocks`` runs of consecutive steps: the rate over a run
    is the totals' ratio (``ratio_estimate``), where a mean of per-step rates would weigh a short
    step as much as a long one."""
    steps = [(r["tokens_per_s"] * r["step_time_s"], r["step_time_s"]) for r in records
             if r.get("tokens_per_s") is not None and r.get("step_time_s")]
    size = max(1, len(steps) // blocks)
    cut = [steps[i:i + size] for i in range(0, size * min(blocks, len(steps)), size)]
    return {"tokens": [round(sum(t for t, _ in b), 1) for b in cut],
            "seconds": [round(sum(s for _, s in b), 4) for b in cut]}


def ratio_estimate(num: list[float], den: list[float]) -> tuple[float | None, float | None]:
    """sum(num)/sum(den) and its standard error over the k blocks (the ratio estimator's)."""
    k, total = len(num), sum(den)
    if k == 0 or total <= 0:
        return None, None
    r = sum(num) / total
    if k < 2:
        return r, None
    mean_den = total / k
    var = sum((a - r * b) ** 2 for a, b in zip(num, den)) / (k * (k - 1))
    return r, math.sqrt(var) / mean_den


DATA_KINDS = ("data_workers", "ray_system", "driver")  # the rank's own CPU is the trainer's


def steady_start(iters: int) -> int:
    """Steps before the steady window (``trainer.summary.steady_window``'s first fifth, at least 2)."""
    return max(2, iters // 5)


def steady_count(marks: list[int], start_micro_batch: int) -> int:
    """Samples a rank took from micro-batch ``start_micro_batch`` on."""
    if not marks or start_micro_batch >= len(marks):
        return 0
    return marks[-1] - (marks[start_micro_batch - 1] if start_micro_batch > 0 else 0)


def steady_cpu(cpu_end: dict, cpu_at_steady: dict | None, steady_samples: int) -> dict:
    """The data path's CPU over the steady window per sample trained in it: start-up (process starts,
    imports, the first read-ahead) left out."""
    if not cpu_at_steady or not steady_samples:
        return {"steady_data_cpu_s": None, "steady_cpu_s_per_trained_sample": None}
    by_kind = {k: cpu_end[k] - cpu_at_steady[k] for k in DATA_KINDS}
    spent = sum(by_kind.values())
    return {"steady_data_cpu_s": round(spent, 2), "steady_samples_trained": steady_samples,
            "steady_cpu_s_per_trained_sample": round(spent / steady_samples, 4),
            # where the steady share goes: the data path's own processes, Ray's, or the case process
            "steady_cpu_s_by_kind": {k: round(v, 2) for k, v in by_kind.items()}}


def has_gpu() -> bool:
    """Whether this process can use a CUDA GPU (False where torch is not installed)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
