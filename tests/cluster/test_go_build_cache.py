"""``hack.localcluster.build.cached_go_build``, which builds the EPP, versitygw and the node's Go
commands into the cache once: a real ``go build`` of a one-file module (seconds with a warm Go
build cache), reused on the next call, never left half-written, built once by concurrent callers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from hack.localcluster.build import _go_env, cached_go_build, go_release_build

pytestmark = pytest.mark.skipif(shutil.which("go") is None, reason="needs the Go toolchain")

MAIN = 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("%s") }\n'


def module(root: Path, word: str) -> Path:
    """A Go module whose command prints ``word``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "go.mod").write_text("module shardline.local/hello\n\ngo 1.21\n")
    (root / "main.go").write_text(MAIN % word)
    return root


@pytest.fixture
def hello(tmp_path) -> tuple[Path, Path]:
    """``(source, target)``: the module printing ``hello`` and its binary's place in a cache."""
    return module(tmp_path / "src", "hello"), tmp_path / "cache" / "v1" / "hello"


def go_build(source: Path, builds: list[Path]):
    """A ``build`` callable for ``cached_go_build`` that records each call."""

    def build(partial: Path) -> None:
        builds.append(partial)
        go_release_build(["build", "-o", str(partial), "."], source, _go_env(source), "build hello")

    return build


def test_the_binary_is_built_once_then_reused(hello):
    (source, target), builds = hello, []
    assert cached_go_build(target, "build hello", go_build(source, builds)) == target
    assert subprocess.run([target], capture_output=True, text=True, check=True).stdout == "hello\n"
    assert builds == [target.with_name("hello.partial")] and not builds[0].exists()
    built = target.stat().st_mtime_ns
    module(source, "changed")  # a second call does not look at the source at all
    assert cached_go_build(target, "build hello", go_build(source, builds)) == target
    assert len(builds) == 1 and target.stat().st_mtime_ns == built
    assert subprocess.run([target], capture_output=True, text=True, check=True).stdout == "hello\n"


def test_a_failed_build_leaves_no_binary_and_the_next_call_builds_again(hello):
    (source, target), builds = hello, []
    (source / "main.go").write_text("package main\n\nfunc main() { undefined() }\n")
    with pytest.raises(RuntimeError, match=r"(?s)build hello failed \(exit 1\).*undefined: undefined"):
        cached_go_build(target, "build hello", go_build(source, builds))
    assert not target.exists()
    module(source, "fixed")
    cached_go_build(target, "build hello", go_build(source, builds))
    assert len(builds) == 2
    assert subprocess.run([target], capture_output=True, text=True, check=True).stdout == "fixed\n"


def test_a_build_that_writes_nothing_is_an_error_naming_it(tmp_path):
    target = tmp_path / "cache" / "v1" / "hello"
    with pytest.raises(RuntimeError, match="build hello: the build wrote no binary at .*hello.partial"):
        cached_go_build(target, "build hello", lambda partial: None)
    assert not target.exists()


def test_an_interrupted_builds_leftover_is_never_promoted(tmp_path):
    target = tmp_path / "cache" / "v1" / "hello"
    target.parent.mkdir(parents=True)
    target.with_name("hello.partial").write_text("half a binary")
    with pytest.raises(RuntimeError, match="the build wrote no binary"):
        cached_go_build(target, "build hello", lambda partial: None)
    assert not target.exists()


def test_concurrent_callers_build_once(hello):
    (source, target), builds = hello, []
    results: list[Path] = []
    build = go_build(source, builds)

    def call() -> None:
        results.append(cached_go_build(target, "build hello", build))

    callers = [threading.Thread(target=call) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(120)
    assert results == [target] * 3
    assert len(builds) == 1, "the callers that waited on the lock reused the binary"
    assert os.access(target, os.X_OK)
