"""What the client layer's ``cp`` loads on its way to the dial.

A cold copy (``gpumesh.Mesh(in_process=True)``, or the first copy of a node
process just started) pays its imports before the dial starts: a consumer's copy
has no use for the provider's job runtime (``gpumesh.runtime.docker``, the
Docker client) or the agent. (The config's ``job_user`` check loads the
runtime's small, plain interface modules, which hold that setting's parser.)

A real copy in a real home, dialling a real loopback port where nothing listens
(refused at once): it ends with its one error, after its dial, and the probe
then lists what it loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.client.node import Node
from tests.integration.test_outgoing_socket import _closed_port
from tests.probe import probe, thin_env

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def test_the_client_layers_cp_dials_without_loading_the_job_runtime(tmp_path: Path) -> None:
    alice, bob = Node(tmp_path / "a"), Node(tmp_path / "b")
    try:
        alice.init("alice")
        bob.init("bob")
        bob.home.store.save_peer(
            alice.home.identity.public_key, "alice", [f"127.0.0.1:{_closed_port()}"], ""
        )
    finally:
        alice.close()
        bob.close()
    source = tmp_path / "data.bin"
    source.write_bytes(b"x" * 1000)
    env = thin_env(tmp_path / "b")
    check = (
        "import sys\n"
        "import gpumesh\n"
        "from gpumesh.errors import GPUMeshError\n"
        "with gpumesh.Mesh(in_process=True) as mesh:\n"
        "    try:\n"
        f"        mesh.cp({str(source)!r}, 'alice:data.bin', retries=0)\n"
        "        code = 0\n"
        "    except GPUMeshError as exc:\n"
        "        print(exc.message, file=sys.stderr)\n"
        "        code = int(exc.exit_code)\n"
        "print(code, 'gpumesh.transport.session' in sys.modules, sorted(m for m in sys.modules\n"
        "      if m.startswith(('gpumesh.runtime.docker', 'gpumesh.agent', 'docker'))))\n"
    )
    result = probe(check, env)
    assert "nothing is listening on 127.0.0.1:" in result.stderr, result.stderr
    # It dialled (and failed as it should), and loaded nothing of a provider's.
    assert result.stdout.splitlines()[-1] == "4 True []", result.stdout + result.stderr
