"""What the in-process ingress tests' stand-in backends share: the read-only catalog of an
:class:`~brokers.ingress.backend.IngressBackend` (one model, serving, no admin API)."""

from __future__ import annotations


class CatalogBackend:
    """The catalog side of a backend: ``served`` models, ``aliases``, one routable worker, no LoRA,
    no announced tokenizer; cancel and forget do nothing (subclasses record what they need)."""

    served: dict[str, int] = {"m": 1}
    aliases: dict[str, str] = {}
    state = "serving"
    admin = None

    def cancel(self, identity) -> None:
        pass

    def forget(self, identity) -> None:
        pass

    def model_catalog(self):
        return dict(self.served), dict(self.aliases), "mesh"

    def lora_catalog(self):
        return {}

    def announced_tokenizers(self):
        return {}

    def routable_workers(self) -> int:
        return 1

    def prompt_token_cap(self) -> int:
        return 0
