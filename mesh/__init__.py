"""mesh: a ZeroMQ request router mesh for LLM inference fleets."""

import os as _os

# gRPC's fork support (on by default in grpcio 1.85) restarts its poller thread in every forked
# child; a child that then closes its inherited descriptors before exec (subprocess with
# preexec_fn, as mesh.lab.procs starts every fleet process) kills that poller's epoll fd and the
# child aborts in gRPC's C core ('epoll_wait error: Bad file descriptor', exit -6) before it
# runs: 2 of 200 such spawns beside a busy channel. mesh never forks a child that goes on using
# gRPC without exec, so it turns fork support off unless the environment says otherwise. It
# must be set before grpc is imported: every mesh module imports this package first.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
