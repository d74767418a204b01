"""The checked-in gRPC code matches indexer.proto (regenerate: ``python -m mesh.indexer.codegen``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.indexer import codegen

REGEN = "python -m mesh.indexer.codegen"


def _stamped_version(path: Path) -> str | None:
    m = re.search(r"\(grpcio-tools ([^)]+)\)", path.read_text().splitlines()[0])
    return m.group(1) if m else None


def test_generated_code_is_byte_identical_to_a_fresh_generation(tmp_path: Path) -> None:
    codegen.generate(tmp_path)
    checked_in = codegen.PACKAGE_DIR / "indexer_pb2.py"
    if _stamped_version(checked_in) != codegen.tools_version():
        pytest.skip(f"checked-in code was generated with grpcio-tools {_stamped_version(checked_in)}, "
                    f"this environment has {codegen.tools_version()} (the descriptor test still runs)")
    for name in codegen.GENERATED:
        fresh = (tmp_path / name).read_bytes()
        ours = (codegen.PACKAGE_DIR / name).read_bytes()
        assert ours == fresh, f"mesh/indexer/{name} is stale: run `{REGEN}`"


def test_descriptor_matches_the_proto_whatever_the_toolchain(tmp_path: Path) -> None:
    """Toolchain-independent: the descriptor compiled from indexer.proto equals the checked-in one."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    out = tmp_path / "indexer.desc"
    rc = protoc.main(["grpc_tools.protoc", f"-I{codegen.REPO_ROOT}", f"--descriptor_set_out={out}", str(codegen.PROTO)])
    assert rc == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    from mesh.indexer import indexer_pb2

    checked_in = descriptor_pb2.FileDescriptorProto.FromString(indexer_pb2.DESCRIPTOR.serialized_pb)
    fresh = fds.file[0]
    _drop_json_names(fresh)  # --descriptor_set_out adds json_name; the embedded descriptor omits it
    assert fresh == checked_in, f"indexer_pb2.py does not match indexer.proto: run `{REGEN}`"


def _drop_json_names(fdp) -> None:
    def walk(msgs):
        for m in msgs:
            for f in m.field:
                f.ClearField("json_name")
            walk(m.nested_type)

    walk(fdp.message_type)


def test_codegen_check_command_reports_up_to_date() -> None:
    r = subprocess.run([sys.executable, "-m", "mesh.indexer.codegen", "--check"], capture_output=True, text=True,
                       timeout=60, cwd=codegen.REPO_ROOT)
    if r.returncode and _stamped_version(codegen.PACKAGE_DIR / "indexer_pb2.py") != codegen.tools_version():
        pytest.skip("different grpcio-tools version")
    assert r.returncode == 0, r.stderr


def test_generated_grpc_module_imports_the_package_absolutely() -> None:
    text = (codegen.PACKAGE_DIR / "indexer_pb2_grpc.py").read_text()
    assert "from mesh.indexer import indexer_pb2" in text
    assert "\nimport indexer_pb2" not in text
