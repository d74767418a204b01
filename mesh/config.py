"""Settings for every mesh process, validated at startup with messages that name the field.

Each process has one frozen dataclass whose fields are declared with
:func:`mesh.settings_fields.setting` (help text, unit, flag): the same declaration generates the
command's argparse flags (:func:`mesh.settings_fields.add_flags`) and the keys its TOML table may
hold. Values come from (lowest to highest precedence) the dataclass defaults, a TOML file
(``[broker]``, ``[worker]``, ... tables; keys are the field or flag names with ``-`` or ``_``),
and command-line flags; an explicitly given flag always wins, even when it equals the default.
:func:`settings_from_args` does that for a parsed command line, :func:`build` merges and
validates plain mappings. Time settings carry their unit in the name.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mesh.errors import ConfigError
from mesh.protocol import MAX_WORKER_ID_BYTES
from mesh.logs import add_log_level_arg
from mesh.proxies import parse_trusted_proxies
from mesh.settings_fields import flag_values, setting, toml_aliases

#: ``--attach`` engine kinds, and how many engines one broker may run the adapters of.
ATTACH_KINDS = ("sglang", "vllm")
MAX_ATTACHED = 64
ATTACH_TRANSPORTS = ("memory", "zmq")
#: ``--attach KIND=URL,NAME=VALUE``: the ``mesh attach`` settings an attached engine may set.
ATTACH_OPTIONS = ("worker_id", "role", "kv_endpoint", "replay_endpoint", "load_endpoint", "block_size", "dp_size")

__all__ = ["BrokerSettings", "WorkerSettings", "load_toml", "build", "settings_from_args", "apply_toml_to_args", "read_toml",
           "model_paths", "check_tokenizers", "suggest_name", "SETTINGS_TABLES"]


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    """Broker process settings. Each field's help text is its ``mesh broker`` flag's ``--help``."""

    frontend: str = setting("tcp://127.0.0.1:5555", help="client-facing endpoint (port * = any free port)")
    backend: str = setting("tcp://127.0.0.1:5556", help="worker-facing endpoint")
    broker_id: str = setting("", default_text="broker-PID", help="name used in logs and metrics")
    heartbeat_ms: int = setting(500, unit="ms", help="application heartbeat interval")
    liveness: int = setting(3, help="heartbeats missed before a worker is expired")
    default_deadline_ms: int = setting(30_000, unit="ms", help="deadline for requests that carry none")
    max_attempts: int = setting(3, help="dispatch attempts per request, first included")
    retry_base_ms: float = setting(25.0, unit="ms", help="retry back-off base")
    retry_cap_ms: float = setting(250.0, unit="ms", help="retry back-off cap")
    retry_budget_ratio: float = setting(0.2, help="concurrent retries allowed per in-flight request")
    retry_budget_min: int = setting(3, help="concurrent retries always allowed")
    max_migrations: int = setting(2, help="times a stream whose worker is lost mid-stream continues on another worker "
                                          "(prompt + tokens so far; 0 = end it with worker_lost)")
    max_inflight: int = setting(100_000, help="requests in flight before new ones get 'overloaded'")
    park_timeout_s: float = setting(2.0, unit="s", help="how long a request waits for a routable worker (startup, restart)")
    max_parked: int = setting(10_000, help="requests that may wait for a worker at once; more get no_worker at once")
    max_inflight_per_worker: int = setting(0, help="per-worker in-flight cap from this broker; at the cap requests queue "
                                                   "(0 = none)")
    queue_timeout_s: float = setting(5.0, unit="s", help="wait for a free slot before 'overloaded' 429")
    eject_after_failures: int = setting(5, help="outlier ejection: consecutive worker errors before a worker is ejected")
    eject_base_s: float = setting(30.0, unit="s", help="ejection time, times the number of ejections (capped at "
                                                       "--eject-max-s)")
    eject_max_s: float = setting(300.0, unit="s", help="longest ejection")
    max_ejected_ratio: float = setting(0.5, help="share of workers that may be ejected at once (at least one may be)")
    drain_timeout_s: float = setting(10.0, unit="s", help="how long SIGTERM waits for in-flight work")
    # Containment (docs/security.md, "Threat model" and "Limits"): what a worker or client may ask for.
    max_worker_heartbeat_ms: int = setting(2000, unit="ms", help="cap on the heartbeat interval a worker may announce")
    max_workers: int = setting(4096, help="registered worker sessions at most; more READYs are refused")
    max_inflight_per_client: int = setting(4096, help="in-flight requests per client before 'rate_limited' 429")
    progress_timeout_ms: int = setting(15_000, unit="ms", help="an attempt that gets no reply at all for this long fails "
                                                               "over and counts against its worker (0 = off)")
    overload_lag_ms: float = setting(250.0, unit="ms", help="shed new requests while the event loop lags more than this")
    policy: str = setting("cache_aware", help="routing policy: cache_aware, cache_aware_greedy, power_of_two, "
                                              "round_robin, random")
    stall_escape_ms: float = setting(200.0, unit="ms", help="cache_aware: leave a holder with --stall-queue-ms of "
                                                             "prefill queued when waiting there takes this much longer "
                                                             "than recomputing the prompt elsewhere (0 = never)")
    stall_queue_ms: float = setting(1000.0, unit="ms", help="cache_aware: the holder queue the stall escape needs "
                                                            "(docs/routing.md: lower let short prompts leave their holders)")
    rank_ties: str = setting("misses", choices=("off", "misses", "holders", "all"),
                             help="cache_aware with several routers: router k takes the k-th of an exact tie among "
                                  "misses (holders, all), while decisions can collide (docs/routing.md)")
    rank_window_prefills: float = setting(100.0, help="cache_aware: part ties only while this router's previous decision "
                                                     "or a peer's dispatch is younger than this many prefills of a "
                                                     "typical request at the workers' measured rate, at most 1 s (docs/routing.md)")
    rank_window_ms: float = setting(0.0, unit="ms", help="cache_aware: a fixed window in wall-clock ms instead of "
                                                         "--rank-window-prefills (0 = derived from it)")
    rank_reach: float = setting(0.03, help="cache_aware with several routers: a parted miss may take a worker whose "
                                          "prefill queue is at most this share of the request's own prompt longer "
                                          "than the shortest (0 = the shortest only; docs/routing.md)")
    regret_audit: str = setting("on", choices=("on", "off"),
                                help="cache_aware: predict for every decision what power_of_two and greedy would "
                                     "have picked from the same view (mesh_regret_ms, mesh_cache_aware_pays_ms; "
                                     "docs/routing.md \"Regret audit\")")
    cache_prefix_provider: str = setting("radix_tree", help="prefix index source: radix_tree, approx, indexer")
    tier_weight_host: float = setting(0.75, help="cache_aware: a matched token held only in an engine's host memory "
                                                 "(SGLang HiCache, vLLM CPU offload) counts this much of a GPU hit; "
                                                 "learnt from outcomes from there (docs/routing.md)")
    tier_weight_store: float = setting(0.25, help="cache_aware: the same for a disk or shared-store tier")
    kv_indexer_endpoint: tuple[str, ...] = setting((), help="shared KV indexer http://HOST:PORT (repeat for replicas)")
    kv_indexer_query_timeout_ms: int = setting(100, unit="ms", help="deadline of one indexer query")
    kv_indexer_query_max_inflight: int = setting(32, help="concurrent indexer queries")
    kv_indexer_token_file: str = setting("", help="file holding the shared KV indexer's bearer token "
                                                  "(mesh indexer --token-file)")
    load_freshness_s: float = setting(5.0, unit="s", help="LoadStat older than this is ignored")
    bucket_config: str = setting("", default_text="one global domain",
                                 help="bucket domains file (TOML or JSON), e.g. configs/buckets-example.toml")
    pd: bool = setting(False, help="prefill/decode disaggregation: route each request to a prefill and a decode worker")
    global_cache_winner: bool = setting(True, flag="--no-global-cache-winner",
                                        default_text="an admitted global winner may bypass it (SGLang #38814)",
                                        help="keep cache winners inside their bucket")
    decode_policy: str = setting("power_of_two", choices=("power_of_two", "legacy_host_affinity"),
                                 help="how --pd picks the decode worker")
    # Session affinity (mesh/routing/sessions.py, docs/routing.md "Sessions")
    session_affinity: str = setting("soft", choices=("off", "soft", "hard"),
                                    help="turns of a session (x-session-id, prompt_cache_key, user, SGLang "
                                         "session_params, or a SUBMIT's session) stick to one worker: soft while it "
                                         "is routable and within the policy's imbalance bound, hard always (engines "
                                         "that keep session state; a turn whose worker is gone fails)")
    session_ttl_s: float = setting(600.0, unit="s", help="a session's pin is forgotten this long after its last turn")
    session_table_size: int = setting(100_000, help="sessions remembered at most (least recently used evicted)")
    session_key_sources: str = setting("header,prompt_cache_key,user,session_params", metavar="LIST",
                                       help="where the HTTP ingress takes a session key from, in this order "
                                            "(comma-separated: header, prompt_cache_key, user, session_params)")
    metrics: str = setting("", default_text="off", help="HOST:PORT for the Prometheus /metrics endpoint (no "
                                                       "authentication: an empty HOST, as in :9100, binds 127.0.0.1 only)")
    http: str = setting("", default_text="off", help="HOST:PORT of the OpenAI-compatible HTTP ingress (port 0 = any "
                                                    "free port)")
    api_key: str = setting("", help="require this bearer token on the HTTP ingress (visible in the process list: "
                                    "prefer --api-key-file or MESH_API_KEY)")
    api_key_file: str = setting("", help="file holding the HTTP ingress bearer token (not visible in the process list; "
                                         "excludes --api-key)")
    http_max_connections: int = setting(512, help="concurrent HTTP connections; beyond it head-waiting/idle ones are "
                                                  "evicted, else 503")
    http_max_connections_per_address: int = setting(128, help="HTTP connections one peer address may hold (0 = no "
                                                              "bound; set 0 behind a reverse proxy, which every "
                                                              "client shares)")
    http_max_body_bytes_per_address: int = setting(32 << 20, unit="bytes", help="request body bytes one peer address "
                                                   "may have in running requests; past it a POST is refused (429) "
                                                   "before its body is read (0 = no bound)")
    http_trusted_proxies: str = setting("", help="comma-separated CIDRs of reverse proxies whose X-Forwarded-For names "
                                                  "the client (per-address bounds, loopback-only admin API)")
    http_header_timeout_s: float = setting(10.0, unit="s", help="time to receive a complete request head")
    http_idle_timeout_s: float = setting(60.0, unit="s", help="idle keep-alive HTTP connections are closed after this")
    http_body_timeout_s: float = setting(30.0, unit="s", help="time to receive a request body or drain a streamed write")
    # HTTP request lifetimes (x-mesh-deadline-ms overrides per request): an unstreamed request
    # ends at http_request_timeout_s; a stream has no total bound, only the idle one between
    # outputs (and the first output), like SGLang's router (request_timeout_secs 1800).
    http_request_timeout_s: float = setting(1800.0, unit="s", help="lifetime of an unstreamed HTTP request (header "
                                                                   "x-mesh-deadline-ms overrides)")
    http_stream_idle_timeout_s: float = setting(300.0, unit="s", help="a stream ends when no output came for this long; "
                                                                      "streams have no total bound unless "
                                                                      "x-mesh-deadline-ms gives one")
    trace_exporter: str = setting("none", choices=("none", "console", "otlp"),
                                  help="OpenTelemetry spans of HTTP requests (the 'tracing' extra): none, console "
                                       "(stderr) or otlp (OTLP/HTTP to --trace-endpoint)")
    trace_endpoint: str = setting("", metavar="URL", help="OTLP/HTTP traces endpoint, e.g. http://otel-collector:4318/v1/traces")
    # HTTP ingress, per model: DIR (every model) or MODEL=DIR, the model folder or its tokenizer.json;
    # chat templates overriding a folder's the same way (see model_paths)
    tokenizer: tuple[str, ...] = setting((), metavar="[MODEL=]DIR|ID",
                                         help="the model folder (tokenizer.json, tokenizer_config.json), or a model id "
                                              "(ORG/NAME) in the local Hugging Face cache, whose tokenizer and chat "
                                              "template the HTTP ingress uses: prompts are routed and sent as the "
                                              "model's token ids. MODEL=DIR for one model (repeatable); a plain DIR for "
                                              "every model without its own. Default: the tokenizer each model's "
                                              "engines announce, from the local cache")
    chat_template: tuple[str, ...] = setting((), metavar="[MODEL=]FILE",
                                             help="a chat template file (.jinja, or .json with chat_template) instead of "
                                                  "the model folder's (MODEL=FILE for one model's)")
    model_name: str = setting("mesh", help="a name for the fleet's only model: requests may use it or the served "
                                           "model's own name")
    model_alias: tuple[str, ...] = setting((), metavar="ALIAS=MODEL",
                                           help="requests for ALIAS go to the workers that serve MODEL (repeatable)")
    # Foreign models (mesh/broker_core/models.py): what a request without a model means, and which
    # READYs announcing a model the fleet does not serve yet are held apart (quarantined).
    default_model: str = setting("", metavar="MODEL", default_text="the majority of long-registered workers",
                                 help="the model requests without a model (or with --model-name) go to")
    models: tuple[str, ...] = setting((), metavar="MODEL",
                                      help="models workers may serve without a CURVE key on the allow-list (repeatable); "
                                           "a READY announcing another model is quarantined until an operator admits it")
    model_settle_s: float = setting(10.0, unit="s", help="a worker registered this long votes for what requests without a model "
                                               "mean; new models are accepted this long after the first registration")
    status_max_workers: int = setting(32, help="worker rows in a STATUS reply to a client that is not authorised "
                                               "(CURVE client allow-list); the reply says truncated")
    status_rate: float = setting(20.0, help="STATUS queries per second per client identity (burst: 4x); "
                                                 "more are refused (rate_limited) and counted")
    telemetry: str = setting("", default_text="off", help="ZeroMQ PUB endpoint for the live telemetry stream (mesh top)")
    # Peer exchange (brokers/peer_exchange.py): this broker's PUB endpoint (port * = any) and
    # the other brokers' exchange endpoints; figures go out at the end of every pump that changed
    # them (0, the default) or at most every exchange_interval_ms (full snapshot every
    # min(1 s, stale / 3)); a peer silent for
    # exchange_stale_ms is dropped and this broker falls back to its own view for it.
    exchange: str = setting("", metavar="ENDPOINT", default_text="off",
                            help="bind this broker's peer exchange PUB here (tcp://HOST:PORT, port * = any): brokers "
                                 "tell each other what they have in flight on each worker, so every broker routes "
                                 "with the fleet's load")
    peer: tuple[str, ...] = setting((), metavar="ENDPOINT", help="another broker's --exchange endpoint to subscribe to "
                                                                 "(repeatable; this broker's own is skipped)")
    exchange_interval_ms: float = setting(0.0, unit="ms", help="at most one change message per interval while "
                                                               "something changed (0: one per broker pump that "
                                                               "changed something, the pump's own batching bounds "
                                                               "the rate)")
    exchange_routes: bool = setting(True, flag="--no-exchange-routes",
                                    help="do not tell the peers where this broker routed each prompt (a few content "
                                         "keys per prompt, sent by default so that a follow-up reaching a peer finds "
                                         "the worker still computing its prefix; docs/routing.md). Peers' routes are "
                                         "taken either way")
    exchange_stale_ms: float = setting(3000.0, unit="ms", help="a peer silent this long is dropped: this broker falls "
                                                               "back to its own view for it")
    exchange_peer_msgs_per_sec: float = setting(2000.0, help="each --peer's budget of exchange messages per second; "
                                                           "more are dropped undecoded and counted")
    exchange_peer_bytes_per_sec: float = setting(4194304.0, help="each --peer's budget of exchange bytes per second "
                                                                     "(at least one 2 MiB message is always admitted)")
    exchange_curve_secret: str = setting("", default_text="--curve-secret", help="this broker's own exchange "
                                         "certificate (.key_secret), with --peer-curve-keys: each broker its own key")
    peer_curve_keys: tuple[str, ...] = setting((), metavar="FILE", help="each --peer's exchange public key (.key), "
                                               "in --peer order: the exchange admits only these keys and binds each "
                                               "peer to its key (needs --curve-secret)")
    curve_secret: str = setting("", default_text="off", help="broker certificate (.key_secret from mesh keygen): CURVE "
                                                            "on both sockets")
    curve_allow_workers: str = setting("", help="directory of worker public keys allowed to register")
    curve_allow_clients: str = setting("", help="directory of client public keys allowed to submit")
    seed: int | None = setting(None, default_text="random", help="seed the routing RNG (deterministic decisions)")
    # Tenants and priorities (mesh/tenants.py, docs/operations.md "Tenants and priorities")
    keys_file: str = setting("", metavar="PATH", help="TOML file mapping API keys to tenants: priority band, weight, "
                                                      "limits, admin right (reloaded on SIGHUP)")
    admin_key_file: str = setting("", metavar="PATH", help="file holding a key for the admin API only (/workers, "
                                                           "mesh ctl); inference keys never open it")
    trust_client_tenant: bool = setting(False, help="take the tenant and priority ZeroMQ clients stamp on their "
                                                    "requests (a mesh gateway with a keys file); needs "
                                                    "--curve-allow-clients, else any client could claim any tenant")
    park_aging_s: float = setting(5.0, unit="s", help="priority aging: a request of band B (0 critical .. 3 low) "
                                                      "waits in the park queue as if it had arrived B x this later, "
                                                      "so low never starves (0 = strict bands)")
    # Recorded decisions (mesh/broker_core/recorder.py, brokers/decision_log.py; docs/operations.md)
    record_decisions: str = setting("", metavar="FILE", default_text="off",
                                    help="record every routed request's arrival, lengths, block ids (no text), decision "
                                         "and TTFT to FILE (JSON lines) for `mesh sim --trace FILE`; rotates FILE -> "
                                         "FILE.1 ...")
    record_max_bytes: int = setting(256 << 20, help="with --record-decisions: bytes per file before it rotates "
                                                    "(at least 65536)")
    record_files: int = setting(4, help="with --record-decisions: files kept, the current one included (disk use "
                                        "<= record_files x record_max_bytes)")
    record_max_ids: int = setting(1 << 20, help="with --record-decisions: distinct prompt blocks one file numbers "
                                                "(about 110 bytes of broker memory each); reaching it starts a new file")
    # Engines attached in the broker process (brokers/attached.py, docs/operations.md)
    attach: tuple[str, ...] = setting((), metavar="KIND=URL",
                                      help="run the adapter of this engine (KIND sglang or vllm, URL http://HOST:PORT) "
                                           "inside the broker, linked to it in process (--attach-transport) instead of a "
                                           "`mesh attach` process and a TCP hop (repeatable; ,NAME=VALUE adds a `mesh attach` setting: "
                                           "worker_id, role, kv_endpoint, replay_endpoint, load_endpoint, block_size, "
                                           "dp_size; vLLM needs kv_endpoint and block_size)")
    attach_transport: str = setting("memory", choices=ATTACH_TRANSPORTS,
                                    help="how attached engines' adapters and the broker exchange messages: memory "
                                         "(frames handed over on the event loop) or zmq (inproc:// sockets)")
    log_level: str = setting("info", add=add_log_level_arg)

    def validate(self) -> None:
        _require(self.heartbeat_ms > 0, "heartbeat_ms", "must be > 0")
        _require(self.liveness >= 1, "liveness", "must be >= 1")
        _require(self.default_deadline_ms > 0, "default_deadline_ms", "must be > 0")
        _require(1 <= self.max_attempts <= 10, "max_attempts", "must be in [1, 10]")
        _require(0 < self.retry_base_ms <= self.retry_cap_ms, "retry_base_ms", "must be > 0 and <= retry_cap_ms")
        _require(0 <= self.retry_budget_ratio <= 1, "retry_budget_ratio", "must be in [0, 1]")
        _require(self.retry_budget_min >= 0, "retry_budget_min", "must be >= 0")
        _require(0 <= self.max_migrations <= 10, "max_migrations", "must be in [0, 10]")
        _require(self.max_inflight > 0, "max_inflight", "must be > 0")
        _require(self.park_timeout_s >= 0, "park_timeout_s", "must be >= 0")
        _require(self.decode_policy in ("power_of_two", "legacy_host_affinity"), "decode_policy",
                 "must be power_of_two or legacy_host_affinity")
        if self.bucket_config:
            _require(Path(self.bucket_config).is_file(), "bucket_config", f"{self.bucket_config} does not exist")
        _require(self.session_affinity in ("off", "soft", "hard"), "session_affinity", "must be off, soft or hard")
        _require(math.isfinite(self.session_ttl_s) and 0 < self.session_ttl_s <= 7 * 86_400, "session_ttl_s",
                 "must be a number of seconds in (0, 604800]")
        _require(type(self.session_table_size) is int and 1 <= self.session_table_size <= 10_000_000,
                 "session_table_size", "must be an integer in [1, 10000000]")
        srcs = self.session_sources()
        _require(all(x in ("header", "prompt_cache_key", "user", "session_params") for x in srcs)
                 and len(set(srcs)) == len(srcs), "session_key_sources",
                 f"must list distinct sources among header, prompt_cache_key, user, session_params, got "
                 f"{self.session_key_sources[:80]!r}")
        _require(type(self.record_max_bytes) is int and 65_536 <= self.record_max_bytes <= 1 << 40, "record_max_bytes",
                 "must be an integer in [65536, 1099511627776]")
        _require(type(self.record_files) is int and 1 <= self.record_files <= 1000, "record_files",
                 "must be an integer in [1, 1000]")
        _require(type(self.record_max_ids) is int and 1024 <= self.record_max_ids <= 1 << 27, "record_max_ids",
                 "must be an integer in [1024, 134217728]")
        if self.record_decisions:
            rp = Path(self.record_decisions)
            _require(len(self.record_decisions) <= 4096 and "\x00" not in self.record_decisions, "record_decisions",
                     "must be a path of at most 4096 characters")
            _require(rp.parent.is_dir(), "record_decisions", f"directory {str(rp.parent)[:200]} does not exist")
            _require(not rp.is_dir(), "record_decisions", f"{self.record_decisions[:200]} is a directory")
        _require(self.max_parked >= 0, "max_parked", "must be >= 0")
        _require(self.max_inflight_per_worker >= 0, "max_inflight_per_worker", "must be >= 0")
        _require(self.queue_timeout_s >= 0, "queue_timeout_s", "must be >= 0")
        _require(math.isfinite(self.park_aging_s) and self.park_aging_s >= 0, "park_aging_s", "must be a finite number >= 0")
        for name in ("keys_file", "admin_key_file"):
            if getattr(self, name):
                _require(Path(getattr(self, name)).is_file(), name, f"{getattr(self, name)} does not exist")
        _require(self.eject_after_failures >= 1, "eject_after_failures", "must be >= 1")
        _require(0 < self.eject_base_s <= self.eject_max_s, "eject_base_s", "must be > 0 and <= eject_max_s")
        _require(0 <= self.max_ejected_ratio <= 1, "max_ejected_ratio", "must be in [0, 1]")
        _require(self.load_freshness_s > 0, "load_freshness_s", "must be > 0")
        for name in ("stall_escape_ms", "stall_queue_ms"):
            v = getattr(self, name)
            _require(math.isfinite(v) and v >= 0, name, f"must be a finite number >= 0, not {v!r}")
        _require(self.rank_ties in ("off", "misses", "holders", "all"), "rank_ties",
                 f"must be off, misses, holders or all, not {str(self.rank_ties)[:40]!r}")
        _require(math.isfinite(self.rank_window_prefills) and 0 <= self.rank_window_prefills <= 100,
                 "rank_window_prefills", f"must be a number in [0, 100], not {self.rank_window_prefills!r}")
        _require(math.isfinite(self.rank_reach) and 0 <= self.rank_reach <= 10, "rank_reach",
                 f"must be a number in [0, 10], not {self.rank_reach!r}")
        _require(math.isfinite(self.rank_window_ms) and 0 <= self.rank_window_ms <= 60_000, "rank_window_ms",
                 f"must be a number in [0, 60000] (0 = derived from rank_window_prefills), not {self.rank_window_ms!r}")
        _require(self.regret_audit in ("on", "off"), "regret_audit", f"must be on or off, not {str(self.regret_audit)[:40]!r}")
        for name in ("tier_weight_host", "tier_weight_store"):
            v = getattr(self, name)
            _require(0 <= v <= 1, name, f"must be a number in [0, 1], not {v!r}")
        _require(self.max_worker_heartbeat_ms >= self.heartbeat_ms, "max_worker_heartbeat_ms", "must be >= heartbeat_ms")
        _require(1 <= self.max_workers <= 100_000, "max_workers", "must be in [1, 100000]")
        _require(self.max_inflight_per_client > 0, "max_inflight_per_client", "must be > 0")
        _require(self.progress_timeout_ms >= 0, "progress_timeout_ms", "must be >= 0 (0 = off)")
        _require(self.overload_lag_ms > 0, "overload_lag_ms", "must be > 0")
        _require(self.log_level in ("debug", "info", "warning", "error"), "log_level", "must be debug|info|warning|error")
        _require(self.trace_exporter in ("none", "console", "otlp"), "trace_exporter", "must be none|console|otlp")
        _require(self.cache_prefix_provider in ("radix_tree", "approx", "indexer"), "cache_prefix_provider",
                 "must be radix_tree, approx or indexer")
        if self.kv_indexer_endpoint and self.cache_prefix_provider != "indexer":
            raise ConfigError("kv_indexer_endpoint: --kv-indexer-endpoint requires --cache-prefix-provider indexer")
        if self.cache_prefix_provider == "indexer" and not self.kv_indexer_endpoint:
            raise ConfigError("cache_prefix_provider: --cache-prefix-provider indexer requires --kv-indexer-endpoint")
        for ep in self.kv_indexer_endpoint:
            _require(ep.startswith(("http://", "https://", "unix:")), "kv_indexer_endpoint",
                     f"{ep!r} needs an explicit http://, https:// or unix: scheme")
        _require(self.kv_indexer_query_timeout_ms > 0, "kv_indexer_query_timeout_ms", "must be > 0")
        _require(self.kv_indexer_query_max_inflight > 0, "kv_indexer_query_max_inflight", "must be > 0")
        if self.kv_indexer_token_file:
            _require(Path(self.kv_indexer_token_file).is_file(), "kv_indexer_token_file",
                     f"{self.kv_indexer_token_file} does not exist")
        if self.api_key_file:
            _require(not self.api_key, "api_key_file", "give either api_key or api_key_file, not both")
            kp = Path(self.api_key_file)
            _require(kp.is_file(), "api_key_file", f"{self.api_key_file} does not exist")
            try:
                key_ok = bool(kp.read_text().strip())
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"api_key_file: cannot read {self.api_key_file}: {exc}") from None
            _require(key_ok, "api_key_file", f"{self.api_key_file} is empty")
        _require(self.http_max_connections >= 1, "http_max_connections", "must be >= 1")
        try:
            parse_trusted_proxies(self.http_trusted_proxies)
        except ValueError as exc:
            _require(False, "http_trusted_proxies", str(exc))
        _require(self.http_max_body_bytes_per_address >= 0, "http_max_body_bytes_per_address", "must be >= 0 (0: no bound)")
        _require(self.http_max_connections_per_address >= 0, "http_max_connections_per_address", "must be >= 0 (0: no bound)")
        check_tokenizers(self.tokenizer, self.chat_template)
        _require(0 < len(self.model_name) <= 256, "model_name", "must be 1..256 characters")
        for a in self.model_alias:
            alias, sep, target = a.partition("=")
            _require(bool(sep and alias and target) and len(alias) <= 256 and len(target) <= 256, "model_alias",
                     f"expected ALIAS=MODEL, got {a!r}")
            _require(alias != target, "model_alias", f"{a!r} maps a name to itself")
        for field, name in (("default_model", self.default_model), *(("models", m) for m in self.models)):
            _require(len(name.encode("utf-8", "replace")) <= 256 and "\x00" not in name, field, "must be at most 256 bytes, no NUL")
            _require(field == "default_model" or bool(name), field, "must not be empty")
        _require(len(self.models) <= 1024, "models", "at most 1024 models")
        _require(not (self.default_model and self.models) or self.aliases().get(self.default_model, self.default_model)
                 in self.models, "default_model", "must be one of --models (or an alias of one)")
        _require(math.isfinite(self.model_settle_s) and 0 <= self.model_settle_s <= 86_400, "model_settle_s",
                 "must be in [0, 86400] seconds")
        _require(1 <= self.status_max_workers <= 1024, "status_max_workers", "must be in [1, 1024]")
        _require(math.isfinite(self.status_rate) and 0 < self.status_rate <= 10_000, "status_rate",
                 "must be in (0, 10000]")
        for name in ("http_header_timeout_s", "http_idle_timeout_s", "http_body_timeout_s", "http_request_timeout_s",
                     "http_stream_idle_timeout_s"):
            v = getattr(self, name)
            _require(math.isfinite(v) and 0 < v <= 86_400, name, "must be a positive number of seconds, at most 86400")
        for name in ("http", "metrics"):
            v = getattr(self, name)
            if v:
                host, sep, port = v.rpartition(":")
                _require(bool(sep) and port.isdigit() and int(port) < 65536, name, f"must be HOST:PORT, got {v!r}")
        if self.trust_client_tenant and not self.curve_allow_clients:
            raise ConfigError("trust_client_tenant: needs --curve-allow-clients (only listed clients, e.g. your gateways, "
                              "may then stamp tenants)")
        if (self.curve_allow_workers or self.curve_allow_clients) and not self.curve_secret:
            raise ConfigError("curve_secret: allow-lists need the broker's --curve-secret")
        for name in ("curve_allow_workers", "curve_allow_clients"):
            v = getattr(self, name)
            if v:
                _require(Path(v).is_dir(), name, f"{v} is not a directory of public keys")
        if self.telemetry:
            _require(self.telemetry.startswith(("tcp://", "ipc://", "inproc://")), "telemetry", "must be a ZeroMQ endpoint")
        for name in ("frontend", "backend"):
            _require(getattr(self, name).startswith(("tcp://", "ipc://", "inproc://")), name, "must be a tcp://, ipc:// or inproc:// endpoint")
        if self.exchange:
            _require(self.exchange.startswith(("tcp://", "ipc://", "inproc://")), "exchange",
                     "must be a tcp://, ipc:// or inproc:// endpoint")
        _require(not self.peer or bool(self.exchange), "peer", "--peer needs --exchange (this broker's own exchange endpoint)")
        _require(len(self.peer) <= 63, "peer", "at most 63 peers")
        for ep in self.peer:
            _require(ep.startswith(("tcp://", "ipc://", "inproc://")) and "*" not in ep, "peer",
                     f"{ep!r} must be a tcp://, ipc:// or inproc:// endpoint to connect to (no *)")
        _require(not self.peer_curve_keys or len(self.peer_curve_keys) == len(self.peer), "peer_curve_keys",
                 f"one public key file per --peer, in order ({len(self.peer_curve_keys)} keys for {len(self.peer)} peers)")
        _require(not (self.peer_curve_keys or self.exchange_curve_secret) or bool(self.curve_secret), "peer_curve_keys",
                 "exchange keys need the broker's --curve-secret (CURVE on)")
        for name, files in (("peer_curve_keys", self.peer_curve_keys), ("exchange_curve_secret", (self.exchange_curve_secret,))):
            for f in files:
                _require(not f or Path(f).is_file(), name, f"{f} is not a key file")
        for name in ("exchange_peer_msgs_per_sec", "exchange_peer_bytes_per_sec"):
            v = getattr(self, name)
            _require(math.isfinite(v) and 0 < v <= 1e12, name, "must be a positive number")
        _require(math.isfinite(self.exchange_interval_ms) and 0 <= self.exchange_interval_ms <= 1000,
                 "exchange_interval_ms", "must be in [0, 1000]")
        _require(math.isfinite(self.exchange_stale_ms) and 3 * self.exchange_interval_ms < self.exchange_stale_ms <= 600_000,
                 "exchange_stale_ms", "must be more than 3 x exchange_interval_ms and at most 600000")
        self.attached_engines()  # ConfigError naming attach
        _require(self.attach_transport in ATTACH_TRANSPORTS, "attach_transport",
                 f"must be one of {', '.join(ATTACH_TRANSPORTS)}, not {str(self.attach_transport)[:40]!r}")

    def attached_engines(self) -> list[tuple[str, str, dict[str, str]]]:
        """``attach`` as (kind, url, options), checked (ConfigError naming ``attach``):
        ``KIND=URL[,NAME=VALUE...]``, KIND sglang or vllm, URL http(s)://HOST:PORT, each URL once,
        at most MAX_ATTACHED; options among ATTACH_OPTIONS (``mesh attach``'s flags of those names,
        e.g. vLLM's kv_endpoint and block_size), their values checked by the adapter's settings."""
        _require(len(self.attach) <= MAX_ATTACHED, "attach", f"at most {MAX_ATTACHED} engines, got {len(self.attach)}")
        out: list[tuple[str, str, dict[str, str]]] = []
        for spec in self.attach:
            shown = repr(spec[:200])
            _require(len(spec) <= 4096, "attach", f"at most 4096 characters, got {len(spec)}")
            kind, sep, rest = spec.partition("=")
            _require(bool(sep), "attach", f"expected KIND=URL (e.g. sglang=http://127.0.0.1:30000), got {shown}")
            _require(kind in ATTACH_KINDS, "attach", f"unknown engine kind {kind[:40]!r} in {shown}: one of "
                                                     f"{', '.join(ATTACH_KINDS)}")
            url, *opts = rest.split(",")
            try:
                u = urlsplit(url)
                port = u.port
            except ValueError:
                u, port = None, None
            _require(u is not None and u.scheme in ("http", "https") and bool(u.hostname) and port is not None
                     and not u.query and not u.fragment, "attach", f"expected KIND=http://HOST:PORT, got {shown}")
            _require(all(url.rstrip("/") != o.rstrip("/") for _, o, _ in out), "attach", f"{url[:200]!r} is attached twice")
            options: dict[str, str] = {}
            for opt in opts:
                name, sep, value = opt.partition("=")
                _require(bool(sep) and name in ATTACH_OPTIONS and name not in options, "attach",
                         f"option {opt[:80]!r} in {shown}: expected NAME=VALUE once each, NAME one of "
                         f"{', '.join(ATTACH_OPTIONS)}")
                options[name] = value
            out.append((kind, url, options))
        return out

    def session_sources(self) -> tuple[str, ...]:
        """``session_key_sources`` as a tuple (empty: the ingress takes no session keys)."""
        return tuple(x.strip() for x in self.session_key_sources.split(",") if x.strip())

    def aliases(self) -> dict[str, str]:
        """``model_alias`` as a map (validated: each entry is ALIAS=MODEL)."""
        return dict(a.split("=", 1) for a in self.model_alias)



@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """Simulated worker process settings (engine timing lives in mesh.engine_model.EngineConfig).
    Each field's help text is its ``mesh worker-stub`` flag's ``--help``."""

    brokers: tuple[str, ...] = setting(("tcp://127.0.0.1:5556",), flag="--broker",
                                       help="broker backend endpoint (repeat for a mesh; dns+tcp://NAME:PORT: every "
                                            "address NAME resolves to, followed as brokers come and go)")
    discovery_refresh_s: float = setting(5.0, unit="s", help="how often dns+tcp:// brokers are resolved again")
    worker_id: str = setting("", help="worker id (with --count N: prefix, ids become ID-0..ID-N-1)",
                             default_text="generated")
    count: int = setting(1, help="workers in this process")
    model: str = setting("sim-llama-8b", help="model name reported in READY")
    role: str = setting("mixed", choices=("mixed", "prefill", "decode"), help="worker role")
    labels: dict[str, str] = setting(default_factory=dict, cli=False, help="labels sent in READY (flag: --label KEY=VALUE)")
    heartbeat_ms: int = setting(500, unit="ms", help="heartbeat interval towards brokers")
    liveness: int = setting(3, help="broker heartbeats missed before reconnecting")
    reconnect_base_ms: float = setting(100.0, unit="ms", cli=False, help="reconnect back-off base")
    reconnect_cap_ms: float = setting(5000.0, unit="ms", cli=False, help="reconnect back-off cap")
    time_scale: float = setting(1.0, help="multiply every modelled duration (0.1 = ten times faster)")
    instant: bool = setting(False, help="answer at once, no engine (benchmarks)")
    curve_secret: str = setting("", help="this worker's certificate (.key_secret)")
    curve_server_key: str = setting("", help="the brokers' public key (.key)")
    log_level: str = setting("info", add=add_log_level_arg)
    tokenizer: str = setting("", default_text="UTF-8 bytes as ids",
                             help="a model folder: text prompts are tokenised with the model's tokenizer, as a real "
                                  "engine does, so KV events carry its token ids")

    def validate(self) -> None:
        _require(len(self.brokers) >= 1, "brokers", "at least one broker endpoint is required")
        from mesh.discovery import check_endpoint

        for b in self.brokers:
            check_endpoint(b, "brokers")
        _require(0.05 <= self.discovery_refresh_s <= 3600, "discovery_refresh_s", "must be in [0.05, 3600] seconds")
        if self.tokenizer:
            _require(Path(self.tokenizer).is_dir(), "tokenizer", f"{self.tokenizer} is not a model folder")
        _require(1 <= self.count <= 4096, "count", "must be in [1, 4096]")
        # bytes, as READY and the peer exchange count them (the -N suffix of --count included)
        _require(len(self.worker_id.encode("utf-8", "surrogatepass")) + (6 if self.count > 1 else 0) <= MAX_WORKER_ID_BYTES, "worker_id",
                 f"must be at most {MAX_WORKER_ID_BYTES} UTF-8 bytes (with --count: {MAX_WORKER_ID_BYTES - 6})")
        _require(self.role in ("prefill", "decode", "mixed"), "role", "must be prefill|decode|mixed")
        _require(self.heartbeat_ms > 0, "heartbeat_ms", "must be > 0")
        _require(self.liveness >= 1, "liveness", "must be >= 1")
        _require(0 < self.reconnect_base_ms <= self.reconnect_cap_ms, "reconnect_base_ms", "must be > 0 and <= reconnect_cap_ms")
        _require(self.time_scale > 0 and math.isfinite(self.time_scale), "time_scale", "must be a positive number")
        _require(bool(self.curve_secret) == bool(self.curve_server_key), "curve_server_key",
                 "CURVE needs both --curve-secret and --curve-server-key")


def _require(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {msg}")


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A whole TOML file; a missing or unparsable file is a ConfigError naming it."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {p}: {exc}") from None


# Every table a mesh settings file may hold (one file can configure several commands); any other
# top-level name is a typo (``[brokr]``) and an error, never silently ignored.
SETTINGS_TABLES = ("broker", "worker", "engine", "indexer", "attach", "stub_sglang")


def suggest_name(name: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_toml(path: str | Path, section: str, allowed=None) -> dict[str, Any]:
    """Read one table of a TOML config file. A missing table is an empty mapping; a top-level
    name that is no settings table (see ``SETTINGS_TABLES``) is a ConfigError naming the file,
    the table and the closest known one; with ``allowed`` (the setting names), so is a key of
    the table that is not one of them."""
    p = Path(path)
    data = read_toml(p)
    for name, val in data.items():
        if name not in SETTINGS_TABLES:
            what = "table" if isinstance(val, dict) else "top-level key"
            raise ConfigError(f"config file {p}: unknown {what} [{name}]{suggest_name(name, SETTINGS_TABLES)}; "
                              f"known tables: {', '.join(SETTINGS_TABLES)}")
    sect = data.get(section, {})
    if not isinstance(sect, dict):
        raise ConfigError(f"config file {p}: [{section}] must be a table")
    out = {k.replace("-", "_"): v for k, v in sect.items()}
    if allowed is not None:
        names = set(allowed)
        for key in out:
            if key not in names:
                raise ConfigError(f"{key}: unknown setting in [{section}] of {p}{suggest_name(key, names)}")
    return out


def model_paths(entries: tuple[str, ...] | list[str], name: str) -> dict[str | None, str]:
    """Per-model paths from ``DIR`` (key None: every model without its own) or ``MODEL=DIR``
    entries (an entry that is itself an existing path is never split at '='). Raises ConfigError
    naming ``name`` for a repeated model."""
    out: dict[str | None, str] = {}
    for e in entries:
        model, sep, path = e.partition("=")
        key: str | None = model
        if not sep or not model or Path(e).exists():
            key, path = None, e
        if key in out:
            raise ConfigError(f"{name}: given twice for {'every model' if key is None else repr(key)}")
        out[key] = path
    return out


def check_tokenizers(tokenizer: tuple[str, ...] | list[str], chat_template: tuple[str, ...] | list[str]) -> None:
    """The ingress' --tokenizer / --chat-template entries (broker and gateway): tokenizers are found
    (folders, or model ids in the local Hugging Face cache), and every chat template belongs to a
    model that has a tokenizer."""
    from mesh.tokenization.hub import resolve_model_dir

    toks = model_paths(tokenizer, "tokenizer")
    for path in toks.values():
        resolve_model_dir(path)  # a folder, or a model id in the local Hugging Face cache; ConfigError naming it
    for model, path in model_paths(chat_template, "chat_template").items():
        _require(model in toks, "chat_template",
                 f"{path} needs a --tokenizer (the model folder) for {'every model' if model is None else repr(model)}")
        _require(Path(path).is_file(), "chat_template", f"{path} does not exist")


def _coerce(name: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{name}: expected a list of strings, got {value!r}")
    if origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return dict(value)
        raise ConfigError(f"{name}: expected a table of string values, got {value!r}")
    return value


def build(cls: type, *sources: dict[str, Any]):
    """Merge ``sources`` (later wins; None values are skipped) into ``cls`` and validate
    (``cls.validate()`` if it has one; EngineConfig checks itself on construction).

    Unknown keys are rejected with a message naming them, and so is a missing required field.
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    merged: dict[str, Any] = {}
    for src in sources:
        for k, v in src.items():
            key = k.replace("-", "_")
            if key not in names:
                raise ConfigError(f"{key}: unknown setting for {cls.__name__}{suggest_name(key, names)} "
                                  f"(known: {', '.join(sorted(names))})")
            if v is not None:
                merged[key] = _coerce(key, v, hints[key])
    for f in dataclasses.fields(cls):
        if f.name not in merged and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{f.name}: required")
    obj = cls(**merged)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj


def settings_from_args(cls: type, args: Any, section: str, *, extra: dict[str, Any] | None = None,
                       dest_prefix: str = "", only=None, specs=None, file_vals: dict[str, Any] | None = None):
    """``cls`` from a parsed command line: dataclass defaults < the ``[section]`` table of
    ``args.config`` (if any) < the flags given (see :mod:`mesh.settings_fields`) < ``extra``;
    validated. The table may use field names and flag names (``broker`` for ``brokers``); any
    other key is a ConfigError naming the file, the table, the key and the closest setting.
    ``only`` limits which of the fields are read from flags (the command exposes those);
    ``file_vals`` replaces reading the file (a caller that already read and adjusted it)."""
    aliases = toml_aliases(cls, specs)
    path = getattr(args, "config", None)
    if file_vals is None:
        file_vals = load_toml(path, section, [f.name for f in dataclasses.fields(cls)] + list(aliases)) if path else {}
    file_vals = dict(file_vals)
    for alias, name in aliases.items():
        if alias in file_vals:
            if name in file_vals:
                raise ConfigError(f"{name}: given twice in [{section}] of {path} (as {alias!r} and {name!r})")
            file_vals[name] = file_vals.pop(alias)
    flags = flag_values(cls, args, dest_prefix=dest_prefix, only=only, specs=specs)
    return build(cls, file_vals, flags, extra or {})


def explicit_dests(parser: Any, argv: list[str]) -> set[str]:
    """The ``dest`` of every option of ``parser`` that ``argv`` gives explicitly (``--x v``,
    ``--x=v``, or a unique prefix as argparse allows), whatever its value."""
    table = getattr(parser, "_option_string_actions", {})
    out: set[str] = set()
    for tok in argv:
        if tok == "--":
            break
        if not tok.startswith("-") or tok == "-":
            continue
        opt = tok.split("=", 1)[0]
        act = table.get(opt)
        if act is None and opt.startswith("--"):
            hits = {a.dest for o, a in table.items() if o.startswith(opt)}
            if len(hits) == 1:
                out |= hits
            continue
        if act is not None:
            out.add(act.dest)
    return out


def apply_toml_to_args(args: Any, parser: Any, path: str | Path, section: str, argv: list[str] | None = None) -> None:
    """For argparse-only commands: fill ``args`` from a TOML table except where the flag was
    given on the command line (``argv``, default ``sys.argv[1:]``): an explicit flag always wins,
    even when its value equals the default. Unknown keys are rejected by name."""
    import sys

    given = explicit_dests(parser, sys.argv[1:] if argv is None else argv)
    known = [k for k in vars(args) if k not in ("func", "config") and not k.startswith("_")]
    for key, value in load_toml(path, section).items():
        if not hasattr(args, key) or key in ("func", "config") or key.startswith("_"):
            raise ConfigError(f"{key}: unknown setting in [{section}] of {path}{suggest_name(key, known)}")
        if key not in given:
            setattr(args, key, value)
