"""The simulated fleet both event loops build the same way (:mod:`mesh.lab.sim.runner`'s routing-only
arms and :mod:`mesh.lab.sim.core_arm`'s broker-core arms): worker names, roles and labels, each
router's router (the product's factory), and one engine step."""

from __future__ import annotations

import random

from mesh.engine_model import EngineModel
from mesh.lab.sim.workloads import seed_key
from mesh.routing import factory
from mesh.routing.buckets import load_bucket_config
from mesh.routing.regret import RegretAudit

__all__ = ["PROVIDER_FEEDS", "policy_base", "engine_step", "roles_and_labels", "make_router", "worker_ids"]

#: How each provider is fed KV events: per router ("local"), once into a shared index ("shared"),
#: or not at all ("none").
#: ``none`` runs without a provider (cache-aware policies then see no matches).
PROVIDER_FEEDS = {"radix_tree": "local", "indexer": "shared", "approx": "none", "none": "none"}


def policy_base(name: str) -> tuple[str, str]:
    """``"cache_aware@b"`` -> ``("cache_aware", "@b")``: an arm tagged ``@TAG`` runs the same
    policy with its workers named differently (the same engines, in another order), so every
    arbitrary choice that hangs on a name (the lowest worker id among equally loaded workers)
    differs and nothing else does. The quality matrix runs its subject twice this way: the
    spread between the two is the cell's noise floor."""
    base, sep, tag = name.partition("@")
    return base, sep + tag


def engine_step(engine: EngineModel, wid: str, t: float):
    """One scheduler step of ``engine`` at ``t`` (its StepResult); an engine that has work but
    makes no progress is a model bug, raised rather than looped on forever."""
    res = engine.step(t)
    if res.duration_s <= 0.0 and not (res.first_tokens or res.finished or res.tokens):
        raise RuntimeError(f"engine {wid} made no progress at t={t}")
    return res


def roles_and_labels(cfg, n: int) -> tuple[list[str], list[dict[str, str]]]:
    """Roles and READY labels of the simulated fleet (bucket selectors match these labels).

    Mixed or prefill workers: the last ``long_pool_share`` are ``pool=long``, the rest
    ``pool=short``; decode workers (``pd``): ``stage=decode``."""
    n_front = n if cfg.pd is None else cfg.pd[0]
    n_long = int(round(n_front * cfg.long_pool_share)) if cfg.buckets else 0
    roles, labels = [], []
    for i in range(n):
        if i < n_front:
            roles.append("prefill" if cfg.pd else "mixed")
            labels.append({"pool": "long" if i >= n_front - n_long else "short"})
        else:
            roles.append("decode")
            labels.append({"stage": "decode"})
    return roles, labels


def make_router(cfg, pol, prov, index: int):
    """The broker's router for simulated router ``index`` (:func:`mesh.routing.factory.make_router`):
    the plain Router, or BucketRouter with buckets and/or P/D. The plain Router audits cache_aware's
    decisions (:mod:`mesh.routing.regret`, on as in the broker; its own RNG, so no choice moves)."""
    bcfg = load_bucket_config(cfg.buckets) if cfg.buckets else None
    audit = RegretAudit(random.Random(seed_key(0x2E6, cfg.seed, index)), shadow_rate=cfg.regret_shadow_rate)
    return factory.make_router(pol, prov, buckets=bcfg, pd=cfg.pd is not None,
                               rng=random.Random(seed_key(0xB0C, cfg.seed, index)), freshness_s=cfg.load_freshness_s,
                               global_cache_winner=cfg.global_cache_winner, decode_policy=cfg.decode_policy,
                               session_affinity=cfg.session_affinity, session_ttl_s=cfg.session_ttl_s,
                               session_table_size=cfg.session_table_size, regret_audit=audit)


def worker_ids(n: int, tag: str = "") -> list[str]:
    """Worker names by engine index; an arm tagged ``@TAG`` (:func:`policy_base`) names the same
    engines in another order, so choices that hang on names (the lowest worker id among equally
    loaded ones) differ and nothing else does."""
    width = max(2, len(str(n - 1)))
    ids = [f"w{i:0{width}d}" for i in range(n)]
    if tag:
        import zlib

        random.Random(zlib.crc32(tag.encode())).shuffle(ids)
    return ids
