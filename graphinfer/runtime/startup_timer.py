"""Start-up breakdown: one INFO line per phase (`start-up: weights 0.41 s`), collected for `bench startup`."""
import contextlib
import logging
import os
import time

from graphinfer.distributed import parallel_state as ps

logger = logging.getLogger("graphinfer.startup")


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartupTimer:
    """Times named phases; each is logged as it ends and kept in `seconds` (a phase entered twice adds up)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def record(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        logger.info("start-up: %s %.2f s", name, seconds)

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            with ps.phase(f"start-up ({name})"):  # named by a collective that fails in it (tensor parallel)
                yield
        finally:
            self.record(name, time.perf_counter() - start)
