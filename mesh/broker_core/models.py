"""Foreign models: what a request without a model means, and which READYs are held apart
(pure: no I/O, no clock).

An unauthenticated worker must not change what a model-less request means (one READY announcing
another model once made every such request a 400, fleet-wide). So:

* **The default model.** A request without a model (or with ``--model-name``) goes to
  ``--default-model`` when it is set (its workers, or it waits for them), else to the model most
  *long-registered* workers serve (registered at least ``--model-settle-s`` ago; while no worker
  is, every registered one votes). Ties go to the model first in name order.
* **Quarantine.** A READY announcing a model the broker has not admitted yet, from a worker that
  is not trusted, is registered *quarantined*: it is listed (STATUS, ``/workers``, the
  ``workers{what=quarantined}`` counter, the ``worker_quarantined`` log event) but never routed
  to and not listed in ``/v1/models``. Trusted: its CURVE key is on the worker allow-list. A
  model is admitted when it is in ``--models`` or is ``--default-model``; without those, the
  models announced within ``--model-settle-s`` of the first registration (the fleet's rollout)
  are admitted, later new ones are not. An operator admits a quarantined worker with ``POST
  /workers/{id}/admit`` (``mesh ctl admit``), which admits its model for good.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from mesh.config import BrokerSettings

__all__ = ["ModelGate", "MAX_ADMITTED_MODELS"]

MAX_ADMITTED_MODELS = 4096  # models remembered as admitted (a trusted fleet of every size fits)


class ModelGate:
    """Which models are admitted, whether a READY is held apart, and the default model."""

    def __init__(self, settings: BrokerSettings) -> None:
        aliases = settings.aliases()
        self.default = aliases.get(settings.default_model, settings.default_model) or None
        self.configured = frozenset(settings.models) | ({self.default} if self.default else frozenset())
        self.settle_s = settings.model_settle_s
        self.admitted: set[str] = set()  # models served by a registration that was not held apart
        self.first_admit_s: float | None = None  # the fleet's first admitted registration

    def holds_apart(self, model: str, trusted: bool, now: float) -> bool:
        """A READY announcing ``model`` (``trusted``: an allow-listed CURVE key) is quarantined."""
        if trusted or model in self.admitted or model in self.configured:
            return False
        if self.configured:
            return True  # the operator said which models the fleet serves
        return self.first_admit_s is not None and now - self.first_admit_s > self.settle_s

    def admit(self, model: str, now: float) -> None:
        """``model`` is served by a registration that was not held apart (or an operator admitted it)."""
        if self.first_admit_s is None:
            self.first_admit_s = now
        if len(self.admitted) < MAX_ADMITTED_MODELS:
            self.admitted.add(model)

    def unnamed(self, served: Iterable[str], registered: Iterable[tuple[str, float]], now: float) -> str | None:
        """The model a request without a model goes to. ``served``: the models with routable,
        admitted workers; ``registered``: (model, registered at) of every admitted worker.
        None: no model is served (the request waits for workers)."""
        if self.default is not None:
            return self.default
        served = set(served)
        if len(served) <= 1:
            return next(iter(served), None)
        votes: Counter[str] = Counter()
        young: Counter[str] = Counter()
        for model, since_s in registered:
            if model in served:
                (votes if now - since_s >= self.settle_s else young)[model] += 1
        votes = votes or young or Counter(served)
        return max(sorted(votes), key=votes.__getitem__)  # ties: the first in name order
