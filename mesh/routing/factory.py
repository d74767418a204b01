"""The one router factory: ``mesh broker``, the simulator and tests build their router here.

Pure: it takes a built policy, provider and (loaded) bucket config; reading files and seeding
belong to the caller.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from mesh.routing.router import PrefixProvider, Router
from mesh.routing.sessions import SessionRouter, with_sessions

if TYPE_CHECKING:
    from mesh.routing.bucket_router import BucketRouter
    from mesh.routing.buckets import BucketConfig
    from mesh.routing.policies import Policy
    from mesh.routing.regret import RegretAudit

__all__ = ["make_router"]


def make_router(policy: Policy, provider: PrefixProvider | None = None, *, buckets: BucketConfig | None = None,
                pd: bool = False, rng: random.Random | None = None, freshness_s: float = 5.0,
                global_cache_winner: bool = True, decode_policy: str = "power_of_two",
                session_affinity: str = "off", session_ttl_s: float = 600.0, session_table_size: int = 100_000,
                session_peers: int = 1, regret_audit: RegretAudit | None = None) -> Router | BucketRouter | SessionRouter:
    """Buckets or P/D: the bucket router (admission, two passes, the decode pick); otherwise the
    plain Router (``rng``, ``freshness_s``, ``global_cache_winner`` and ``decode_policy`` are the
    bucket router's). ``session_affinity`` soft or hard wraps it in the session stage
    (:mod:`mesh.routing.sessions`; ``session_peers``: routers sharing pins over the exchange).
    ``regret_audit``: the plain Router audits its cache_aware decisions (:mod:`mesh.routing.regret`)."""
    if buckets is None and not pd:
        router: Router | BucketRouter = Router(policy, provider, regret_audit)
    else:
        from mesh.routing.bucket_router import BucketRouter

        router = BucketRouter(buckets, policy, provider, rng=rng, freshness_s=freshness_s, pd=pd,
                              global_cache_winner=global_cache_winner, decode_policy=decode_policy)
    return with_sessions(router, session_affinity, session_ttl_s, session_table_size, peers=session_peers)
