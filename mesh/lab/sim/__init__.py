"""``mesh sim``: discrete-event simulation of routers + engine models in virtual time.

See :mod:`mesh.lab.sim.runner` for the model and the metric definitions, :mod:`mesh.lab.sim.workloads`
for the request streams.
"""

from mesh.lab.sim.runner import ArmSpec, SimConfig, arm_specs, build_workload, run_arm, run_sim
from mesh.lab.sim.workloads import Workload, load_mooncake, make_workload, oracle_cached_tokens

__all__ = ["SimConfig", "ArmSpec", "run_sim", "run_arm", "arm_specs", "build_workload", "Workload", "load_mooncake",
           "make_workload", "oracle_cached_tokens"]
