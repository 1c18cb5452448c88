"""Host collector (psutil): how hard the target's threads work, its memory, and the host's CPU and memory.

A serving loop is one Python thread; when it sits at 100 % of a core the GPU waits for it however fast the GPU is.
So beside the tree's total CPU (in cores) this records the busiest single thread as a fraction of one core.

Per-thread CPU comes from /proc/<pid>/task/<tid>/schedstat (time on CPU in nanoseconds: one small read per
thread, about a third of the cost of psutil's per-thread stat parsing, and no 10 ms tick quantisation); where the
kernel has no schedstat, psutil's thread times are used. The default period (0.5 s) keeps the cost of reading every
thread of a many-threaded server small; the busiest thread is a median over the window, so 2 Hz is plenty.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from diagnoser import signals as S
from diagnoser.capture import Capture
from diagnoser.collectors.base import SeriesBook
from diagnoser.collectors.process import ProcessTree

DEFAULT_PERIOD_S = 0.5
WORKING_THREAD = 0.05  # share of a core a thread must use in an interval for its run-queue wait to count


class HostCollector:
    name = "host"

    def __init__(self, tree: ProcessTree | None, period_s: float = DEFAULT_PERIOD_S) -> None:
        self.tree = tree
        self.period_s: float | None = period_s
        self.book: SeriesBook | None = None
        self._prev_t: float | None = None
        self._prev_host: tuple[float, float] | None = None  # (busy, total) CPU seconds of the host
        self._prev_proc: dict[int, tuple[float, int]] = {}  # pid -> (cpu seconds, context switches)
        self._prev_thread: dict[tuple[int, int], float] = {}  # (pid, tid) -> cpu seconds
        self._thread_total: dict[tuple[int, int], float] = {}  # CPU each thread used during the window
        self._denied: set[str] = set()
        self._schedstat = True
        self._cores = psutil.cpu_count() or 1
        self._host_busy_cores: float | None = None  # cores the whole host used in the last interval
        self._own_prev: float | None = None  # CPU seconds of this tool's own tree (it and py-spy) so far
        # (pid, tid) -> seconds spent runnable but not running (schedstat's run-queue wait), as last read
        self._waits: dict[tuple[int, int], float] = {}
        self._prev_wait: dict[tuple[int, int], float] = {}

    def start(self, capture: Capture) -> None:
        self.book = SeriesBook(capture, "psutil")

    # --- sampling ----------------------------------------------------------------------------------------

    def sample(self, t: float) -> None:
        assert self.book is not None
        dt = None if self._prev_t is None else t - self._prev_t
        self._sample_host(t, dt)
        if self.tree is not None:
            self._sample_tree(t, dt)
        self._prev_t = t

    def _sample_host(self, t: float, dt: float | None) -> None:
        assert self.book is not None
        times = psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        total = sum(times)
        # guest time is already counted in user on Linux; subtracting keeps 'total' the real elapsed CPU time
        total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
        busy = total - idle
        self._host_busy_cores = None
        if self._prev_host is not None:
            d_total = total - self._prev_host[1]
            if d_total > 0:
                frac = max(0.0, min(1.0, (busy - self._prev_host[0]) / d_total))
                self.book.add(S.HOST_CPU_FRAC, t, frac)
                self._host_busy_cores = frac * self._cores
                self.book.add(S.HOST_CORES, t, float(self._cores))
        self._prev_host = (busy, total)
        self.book.add(S.HOST_MEM_USED_FRAC, t, psutil.virtual_memory().percent / 100.0)

    def _sample_tree(self, t: float, dt: float | None) -> None:
        assert self.book is not None and self.tree is not None
        cpu_sum = rss_sum = threads_sum = 0.0
        ctx_rate = 0.0
        busiest = 0.0
        # The largest share of the interval any working thread of the target spent runnable but waiting for a CPU.
        # Not the busiest thread's alone: a spinning OpenMP thread is the busiest and never waits, while its partner
        # at the barrier waits for a core and holds every step back.
        worst_wait: float | None = None
        seen_threads: set[tuple[int, int]] = set()
        counted = 0
        for proc in self.tree.processes(t):
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    cpu = times.user + times.system
                    rss = proc.memory_info().rss
                    n_threads = proc.num_threads()
                    ctx = proc.num_ctx_switches()
                threads = self._thread_times(proc)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                self.tree.forget(proc.pid)
                continue
            except psutil.AccessDenied:
                self._deny(S.HOST_TARGET_CPU, proc.pid)
                continue
            counted += 1
            switches = ctx.voluntary + ctx.involuntary
            prev = self._prev_proc.get(proc.pid)
            if prev is not None and dt:
                cpu_sum += max(0.0, cpu - prev[0]) / dt
                ctx_rate += max(0, switches - prev[1]) / dt
            self._prev_proc[proc.pid] = (cpu, switches)
            rss_sum += rss
            threads_sum += n_threads
            for tid, used in threads.items():
                key = (proc.pid, tid)
                seen_threads.add(key)
                before = self._prev_thread.get(key)
                if before is not None and dt:
                    delta = max(0.0, used - before)
                    self._thread_total[key] = self._thread_total.get(key, 0.0) + delta
                    busiest = max(busiest, delta / dt)
                    waited, was = self._waits.get(key), self._prev_wait.get(key)
                    if delta / dt >= WORKING_THREAD and waited is not None and was is not None:
                        worst_wait = max(worst_wait or 0.0, max(0.0, waited - was) / dt)
                self._prev_thread[key] = used
                if key in self._waits:
                    self._prev_wait[key] = self._waits[key]
        self._prev_thread = {k: v for k, v in self._prev_thread.items() if k in seen_threads}
        self._waits = {k: v for k, v in self._waits.items() if k in seen_threads}
        self._prev_wait = {k: v for k, v in self._prev_wait.items() if k in seen_threads}
        if counted == 0:
            return
        self.book.add(S.HOST_TARGET_RSS_BYTES, t, rss_sum)
        self.book.add(S.HOST_TARGET_THREADS, t, threads_sum)
        if dt:
            self.book.add(S.HOST_TARGET_CPU, t, cpu_sum)
            own = self._own_cpu(dt)
            if self._host_busy_cores is not None and own is not None:
                # What the rest of the host took in the same interval, this tool's own sampling left out: other
                # tenants starve a server of its CPU.
                self.book.add(S.HOST_OTHERS_CPU, t, max(0.0, self._host_busy_cores - cpu_sum - own))
            self.book.add(S.HOST_TARGET_BUSIEST_THREAD, t, min(busiest, 1.0))
            if worst_wait is not None:
                self.book.add(S.HOST_TARGET_CPU_WAIT, t, min(worst_wait, 1.0))
            self.book.add(S.HOST_TARGET_CTX_SWITCHES_PER_S, t, ctx_rate)

    def _own_cpu(self, dt: float) -> float | None:
        """Cores this process and its children (a stack sampler) used since the last call; None on the first."""
        try:
            me = psutil.Process()
            total = 0.0
            for proc in (me, *me.children(recursive=True)):
                try:
                    times = proc.cpu_times()
                    total += times.user + times.system
                except psutil.Error:
                    continue
        except psutil.Error:
            return None
        before, self._own_prev = self._own_prev, total
        return None if before is None else max(0.0, total - before) / dt

    def _thread_times(self, proc: psutil.Process) -> dict[int, float]:
        """CPU seconds used so far by each thread of a process (tid -> seconds)."""
        if self._schedstat:
            found = _schedstat_times(proc.pid)
            if found is not None:
                for tid, (_, wait) in found.items():
                    self._waits[(proc.pid, tid)] = wait
                return {tid: cpu for tid, (cpu, _) in found.items()}
            if not proc.is_running():
                raise psutil.NoSuchProcess(proc.pid)
            self._schedstat = False  # this kernel has no schedstat: psutil from now on
        return {th.id: th.user_time + th.system_time for th in proc.threads()}

    def _deny(self, what: str, pid: int) -> None:
        assert self.book is not None
        if what not in self._denied:
            self._denied.add(what)
            self.book.capture.mark_unavailable(
                "psutil", what, f"no permission to read /proc/{pid} (another user's process)",
                "run diagnoser as the target's user or as root")

    # --- end of window -----------------------------------------------------------------------------------

    def stop(self, t: float) -> None:
        assert self.book is not None
        if self._thread_total and self._prev_t:
            (pid, tid), used = max(self._thread_total.items(), key=lambda kv: kv[1])
            share = used / max(self._prev_t, 1e-9)
            if share >= 0.05:
                name = _thread_name(pid, tid)
                self.book.capture.notes.append(
                    f"Busiest thread of the target: {name!r} (pid {pid}, tid {tid}) used {share:.0%} of a core "
                    "over the window.")

    def latest(self) -> dict[str, float]:
        return dict(self.book.newest) if self.book else {}


def _schedstat_times(pid: int) -> dict[int, tuple[float, float]] | None:
    """tid -> (seconds on CPU, seconds runnable but waiting for a CPU), from /proc/<pid>/task/<tid>/schedstat; None
    when the process has no schedstat files."""
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return None
    out: dict[int, tuple[float, float]] = {}
    for tid in tids:
        try:
            fd = os.open(f"{base}/{tid}/schedstat", os.O_RDONLY)
        except FileNotFoundError:
            continue  # the thread ended between listdir and open
        except OSError:
            return None
        try:
            fields = os.read(fd, 128).split()
            out[int(tid)] = (int(fields[0]) / 1e9, int(fields[1]) / 1e9)
        except (OSError, ValueError, IndexError):
            return None
        finally:
            os.close(fd)
    return out or None


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"
