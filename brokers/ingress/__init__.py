"""OpenAI-compatible and SGLang HTTP front door of ``mesh broker --http`` and ``mesh gateway``.

An HTTP request becomes an ordinary mesh SUBMIT from a *local client* of an
:class:`~brokers.ingress.backend.IngressBackend` (the broker's mailbox, or remote brokers for the
gateway), so HTTP traffic gets the same routing, retries, deadlines and exactly-one-terminal
guarantee as ZeroMQ clients. By concern:

* :mod:`.app`: :class:`HttpIngress`, routes, API key, lifecycle, ``/v1/models``, health, metrics,
  the admin API;
* :mod:`.submit`: HTTP -> SUBMIT (headers, body, prompt, tokenizer, parameters, size limits);
* :mod:`.tokenizers`: each model's tokenizer (flag-named, else the one its engines announce) and
  the report of text sent without one;
* :mod:`.openai_api`: ``/v1/completions`` and ``/v1/chat/completions`` bodies;
* :mod:`.passthrough`: what goes to the engine's own OpenAI server (tools, reasoning, ``n`` > 1,
  Responses, embeddings, rerank, score);
* :mod:`.generate`: SGLang's ``/generate``;
* :mod:`.endpoint`: what those two share (refusals, the wait for an unstreamed FINAL);
* :mod:`.replies`: one request's replies, JSON errors, SSE streaming;
* :mod:`.http1`: the HTTP/1.1 server (httptools, one protocol object per connection, direct writes);
* :mod:`.web`: the Request / Response surface the endpoints see;
* :mod:`.guard`: connection limits and timeouts (slowloris);
* :mod:`.backend`: the seam to "a broker".
"""

from brokers.ingress.app import HttpIngress
from brokers.ingress.backend import IngressBackend
from brokers.ingress.submit import MAX_BODY_BYTES, MAX_SUBMIT_BYTES

__all__ = ["HttpIngress", "IngressBackend", "MAX_BODY_BYTES", "MAX_SUBMIT_BYTES"]
