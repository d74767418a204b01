"""The one router factory: ``mesh broker``, the simulator and tests build their router here.

Pure: it takes a built policy, provider and (loaded) bucket config; reading files and seeding
belong to the caller.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from mesh.routing.router import PrefixProvider, Router

if TYPE_CHECKING:
    from mesh.routing.bucket_router import BucketRouter
    from mesh.routing.buckets import BucketConfig
    from mesh.routing.policies import Policy

__all__ = ["make_router"]


def make_router(policy: Policy, provider: PrefixProvider | None = None, *, buckets: BucketConfig | None = None,
                pd: bool = False, rng: random.Random | None = None, freshness_s: float = 5.0,
                global_cache_winner: bool = True, decode_policy: str = "power_of_two") -> Router | BucketRouter:
    """Buckets or P/D: the bucket router (admission, two passes, the decode pick); otherwise the
    plain Router (``rng``, ``freshness_s``, ``global_cache_winner`` and ``decode_policy`` are the
    bucket router's)."""
    if buckets is None and not pd:
        return Router(policy, provider)
    from mesh.routing.bucket_router import BucketRouter

    return BucketRouter(buckets, policy, provider, rng=rng, freshness_s=freshness_s, pd=pd,
                        global_cache_winner=global_cache_winner, decode_policy=decode_policy)
