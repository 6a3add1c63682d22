"""The executor for a layout.

  UniprocExecutor     one rank: the Worker in this process (executor/abstract.py)
  MultiprocExecutor   tensor / pipeline parallel: rank 0's Worker here, the replica's other ranks in processes of their own
                      (executor/multiproc_executor.py), each step sent to them before rank 0 runs it

Data parallel sits above them (engine/dp_core.py): each replica's engine core has its own executor.
"""
from graphinfer.config import EngineConfig
from graphinfer.platforms import KernelBackend, Platform
from graphinfer.runtime.executor.abstract import Executor, UniprocExecutor
from graphinfer.runtime.executor.multiproc_executor import MultiprocExecutor
from graphinfer.runtime.startup_timer import StartupTimer


def make_executor(config: EngineConfig, platform: Platform, backend: KernelBackend,
                  timer: StartupTimer | None = None) -> Executor:
    """The executor for one replica of config's layout (tensor_parallel_size ranks), its workers built."""
    timer = timer or StartupTimer()
    if config.parallel_config.world_size > 1:
        return MultiprocExecutor(config, platform, backend, timer)
    return UniprocExecutor(config, platform, backend, timer)
