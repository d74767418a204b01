"""Every mesh command line in the deployment files parses with mesh's own parser and builds valid
settings (issue 17 part 3): a renamed or removed flag fails here, not in someone's cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mesh.cli import build_parser
from mesh.config import BrokerSettings, settings_from_args

ROOT = Path(__file__).resolve().parents[1]


def _compose_commands() -> list[tuple[str, list[str]]]:
    doc = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    return [(f"compose:{name}", svc["command"]) for name, svc in doc["services"].items() if svc.get("image") == "mesh"]


def _k8s_commands() -> list[tuple[str, list[str]]]:
    out = []
    for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "mesh.yaml").read_text()):
        spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            if c["image"].split(":")[0] == "mesh":
                out.append((f"k8s:{doc['metadata']['name']}/{c['name']}", c["args"]))
    return out


COMMANDS = _compose_commands() + _k8s_commands()


def test_the_manifests_hold_every_role():
    names = " ".join(n for n, _ in COMMANDS)
    for role in ("broker", "indexer", "adapter", "engine"):
        assert role in names, names
    assert len(COMMANDS) >= 10
    # the indexer runs as two replicas of one Valkey state in both files, and brokers list both
    for where in ("compose:", "k8s:"):
        idx = [a for n, a in COMMANDS if n.startswith(where) and a[0] == "indexer"]
        assert idx and all(a[a.index("--backend") + 1] == "valkey" for a in idx), (where, idx)
        brokers = [a for n, a in COMMANDS if n.startswith(where) and a[0] == "broker"]
        assert brokers and all(a.count("--kv-indexer-endpoint") == 2 for a in brokers), where


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[n for n, _ in COMMANDS])
def test_manifest_command_lines_parse_and_validate(where, argv, monkeypatch, tmp_path):
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's answer to an unknown flag or a bad value
        pytest.fail(f"{where}: mesh {' '.join(argv)} does not parse (exit {exc.code})")
    args._argv = list(argv)
    cmd = argv[0]
    token = tmp_path / "token"  # the manifests mount secrets at these paths: stand in files for them
    token.write_text("t" * 32)
    if cmd == "broker":
        if args.api_key_file:
            key = tmp_path / "api-key"
            key.write_text("k" * 32)
            args.api_key_file = str(key)
        if args.kv_indexer_token_file:
            args.kv_indexer_token_file = str(token)
        settings_from_args(BrokerSettings, args, "broker")
    elif cmd == "attach":
        from mesh.adapters.cli import settings_from_args as attach_settings

        attach_settings(args)
    elif cmd == "indexer":
        from mesh.indexer.cli import indexer_settings

        if args.token_file:
            args.token_file = str(token)
        if args.valkey_password_file:  # issue 32: the manifests give Valkey's password as a secret file
            args.valkey_password_file = str(token)
        indexer_settings(args)
    elif cmd == "stub-sglang":
        from workers_stub.sglang_cli import settings_from_args as stub_settings

        stub_settings(args)
