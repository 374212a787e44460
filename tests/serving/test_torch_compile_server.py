"""A server started with ``--enable-torch-compile`` says so in ``/get_server_info`` (the flag,
its batch-size limit and the sizes that really run compiled). On the CPU nothing compiles before
a size's first decode step, so the server starts as fast as an eager one; the compiled logits
are checked against eager in ``tests/runtime/test_torch_compile.py``."""

from __future__ import annotations

import pytest

from serving_server import start_server


@pytest.fixture(scope="module")
def compiled_server(serving_checkpoint, checkpoint_dir):
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "2048",
                       "--enable-torch-compile", "--torch-compile-max-bs", "2")
    yield srv
    srv.stop()


@pytest.mark.slow  # starts a server
def test_server_info_reports_torch_compile(compiled_server):
    info = compiled_server.get("/get_server_info").json()
    assert info["enable_torch_compile"] is True
    assert info["torch_compile_max_bs"] == 2
    assert info["cuda_graphs"]["torch_compile_batch_sizes"] == [1, 2]

