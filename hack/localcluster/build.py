"""Build (or reuse) the local control-plane binaries: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler at Kubernetes v1.37.2, and the helm 3 CLI; and, for
the real node (``NODE_BINARIES``), the kubelet and kube-proxy from the same wrapper module,
crictl and CoreDNS.

Nothing built here is committed. Binaries go to a versioned cache outside the repository,
``~/.cache/shardline/k8s-v1.37.2/bin/`` (override the root with ``SHARDLINE_CACHE``), and are
built only when one is missing. Usable from the shell (``python3 -m hack.localcluster build``) and from
Python (``ensure_binaries()``) for the test fixture and the demo.

Why a wrapper module: ``go install k8s.io/kubernetes/cmd/...@v1.37.2`` is refused because the
module's go.mod has ``replace`` directives (its staging modules point at ``./staging``). A small
wrapper module requires ``k8s.io/kubernetes v1.37.2`` and replaces every staging module
``k8s.io/X`` with the published ``k8s.io/X v0.37.2``; the list of staging modules is derived from
the module's own go.mod as the module proxy serves it, so it cannot drift. etcd is a five-line
``main`` in the same module, so it builds at the version the Kubernetes module graph selects.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

K8S_VERSION = "v1.37.2"
HELM_VERSION = "v3.22.0"
CRICTL_VERSION = "v1.37.0"
COREDNS_VERSION = "v1.15.0"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
# Built from the Kubernetes wrapper module too, but only when a real node is asked for.
K8S_NODE = ("kubelet", "kube-proxy")
K8S_COMMANDS = CONTROL_PLANE + K8S_NODE
ALL_BINARIES = CONTROL_PLANE + ("helm",)
NODE_BINARIES = K8S_NODE + ("crictl", "coredns")
# Standalone Go commands installed with ``go install PKG@VERSION`` (no replace directives).
GO_INSTALLS = {
    "crictl": f"sigs.k8s.io/cri-tools/cmd/crictl@{CRICTL_VERSION}",
    "coredns": f"github.com/coredns/coredns@{COREDNS_VERSION}",
}
# Used only when the machine's Go is older than the module's go directive.
FALLBACK_TOOLCHAIN = "go1.27.3"

ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


def cache_root() -> Path:
    """Root of Shardline's build cache (``$SHARDLINE_CACHE`` or ``~/.cache/shardline``)."""
    return Path(os.environ.get("SHARDLINE_CACHE", Path.home() / ".cache" / "shardline"))


def bin_dir(version: str = K8S_VERSION) -> Path:
    """Directory holding the cached binaries for one Kubernetes version."""
    return cache_root() / f"k8s-{version}" / "bin"


def missing_binaries(version: str = K8S_VERSION,
                     names: tuple[str, ...] = ALL_BINARIES) -> list[str]:
    """Names among ``names`` not yet present (and executable) in the cache."""
    d = bin_dir(version)
    return [b for b in names if not os.access(d / b, os.X_OK)]


def _log(msg: str) -> None:
    print(f"[k8s-build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], what: str,
         quiet_lines: bool = False) -> str:
    """Run a Go command. Output lines are echoed (or, with ``quiet_lines``, counted: ``go
    build -v`` names each package it compiles), and a heartbeat is printed every 30 s so a
    long build never looks like a hang."""
    _log(f"{what}: {' '.join(cmd)}")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out_lines: list[str] = []
    finished = threading.Event()

    def heartbeat() -> None:
        while not finished.wait(30):
            _log(f"{what}: still running ({time.monotonic() - started:.0f} s, "
                 f"{len(out_lines)} packages/lines so far)")

    threading.Thread(target=heartbeat, daemon=True).start()
    assert proc.stdout is not None
    for line in proc.stdout:
        out_lines.append(line)
        if not quiet_lines:
            print("    " + line.rstrip(), flush=True)
    rc = proc.wait()
    finished.set()
    _log(f"{what}: finished in {time.monotonic() - started:.0f} s (exit {rc})")
    if rc != 0:
        tail = "".join(out_lines[-40:])
        raise RuntimeError(f"{what} failed (exit {rc}): {' '.join(cmd)}\n{tail}")
    return "".join(out_lines)


def cached_go_build(target: Path, what: str, build: Callable[[Path], None]) -> Path:
    """Return ``target`` (a binary path in the cache), first running ``build(partial)`` when it
    is missing. ``build`` writes the binary to ``partial`` (beside ``target``), which is renamed
    to ``target`` only once it returned, so a failed or interrupted build never leaves a
    ``target`` behind. Concurrent builders take turns on a lock file beside ``target``'s
    directory; the one that waited finds the binary built and reuses it.

    Raises:
        RuntimeError: the build failed (from ``build``: the command and its output tail), or
            ``build`` returned without writing ``partial`` (names ``what``).
    """
    if os.access(target, os.X_OK):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent.parent / f".{target.parent.name}.build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(target, os.X_OK):
            return target
        partial = target.with_name(target.name + ".partial")
        partial.unlink(missing_ok=True)  # an interrupted build's leftover is never promoted
        build(partial)
        if not partial.is_file():
            raise RuntimeError(f"{what}: the build wrote no binary at {partial}")
        partial.replace(target)
    return target


def go_release_build(args: list[str], cwd: Path, env: dict[str, str], what: str) -> None:
    """``go ARGS[0] -trimpath -ldflags "-s -w" ARGS[1:]`` at low priority (``nice -n 10``).

    Raises:
        RuntimeError: go failed (the command and its output tail).
    """
    _run(["nice", "-n", "10", "go", args[0], "-trimpath", "-ldflags", "-s -w", *args[1:]], cwd,
         env, what)


def go_install_cached(package: str, version: str, target: Path, what: str) -> Path:
    """``go install PACKAGE@VERSION`` into ``target`` (a binary path in the cache) unless it is
    already there (:func:`cached_go_build`).

    Raises:
        RuntimeError: the build failed (the command and its output tail).
    """

    def install(partial: Path) -> None:
        gobin = target.parent / ".gobin"
        env = dict(_go_env(target.parent), GOBIN=str(gobin))
        go_release_build(["install", f"{package}@{version}"], target.parent, env, what)
        (gobin / package.rsplit("/", 1)[-1]).replace(partial)
        shutil.rmtree(gobin, ignore_errors=True)

    return cached_go_build(target, what, install)


def _go_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GOFLAGS", "-buildvcs=false")
    env["GOWORK"] = "off"
    env["CGO_ENABLED"] = env.get("CGO_ENABLED", "0")
    return env


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _staging_modules(gomod_text: str) -> list[str]:
    """Every ``k8s.io/X => ./staging/src/k8s.io/X`` line of the kubernetes go.mod."""
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.\-/]+)\s+=>\s+\./staging/", gomod_text,
                                 flags=re.M)))


def _prepare_module(work: Path, env: dict[str, str], version: str) -> None:
    """Write the wrapper go.mod (requires + derived staging replaces) and the etcd main."""
    work.mkdir(parents=True, exist_ok=True)
    text = _run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
                work, env, "download kubernetes go.mod")
    info = json.loads(text[text.index("{"):text.rindex("}") + 1])
    gomod = Path(info["GoMod"]).read_text()
    staging = _staging_modules(gomod)
    if len(staging) < 20:
        raise RuntimeError(f"found only {len(staging)} staging modules in {info['GoMod']}")
    go_directive = re.search(r"^go\s+(\S+)", gomod, flags=re.M).group(1)
    local = subprocess.run(["go", "env", "GOVERSION"], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
    if _version_tuple(local) < _version_tuple(go_directive):
        _log(f"local {local} < go {go_directive}: using GOTOOLCHAIN={FALLBACK_TOOLCHAIN}")
        env["GOTOOLCHAIN"] = FALLBACK_TOOLCHAIN
    staging_version = "v0." + version.lstrip("v").split(".", 1)[1]
    lines = ["module shardline.local/k8sbins", "", f"go {go_directive}", "",
             f"require k8s.io/kubernetes {version}", ""]
    lines += [f"replace {m} => {m} {staging_version}" for m in staging]
    (work / "go.mod").write_text("\n".join(lines) + "\n")
    (work / "etcd").mkdir(exist_ok=True)
    (work / "etcd" / "main.go").write_text(ETCD_MAIN)
    _log(f"wrapper module at {work}: {len(staging)} staging replaces -> {staging_version}")
    pkgs = [f"k8s.io/kubernetes/cmd/{b}@{version}" for b in K8S_COMMANDS if b != "etcd"]
    _run(["go", "get"] + pkgs, work, env, "resolve kubernetes commands")
    # Pin etcd to the version the Kubernetes module graph already selected, so adding the
    # etcd main upgrades nothing the control-plane binaries link.
    etcd_version = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Version}}", "go.etcd.io/etcd/server/v3"], cwd=work,
        env=env, capture_output=True, text=True, check=True).stdout.strip()
    _run(["go", "get", f"go.etcd.io/etcd/server/v3/etcdmain@{etcd_version}"], work, env,
         f"resolve etcd {etcd_version}")


def _k8s_ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    x = {
        "k8s.io/component-base/version.gitMajor": major,
        "k8s.io/component-base/version.gitMinor": minor,
        "k8s.io/component-base/version.gitVersion": version,
        "k8s.io/component-base/version.gitTreeState": "clean",
        "k8s.io/client-go/pkg/version.gitMajor": major,
        "k8s.io/client-go/pkg/version.gitMinor": minor,
        "k8s.io/client-go/pkg/version.gitVersion": version,
        "k8s.io/client-go/pkg/version.gitTreeState": "clean",
    }
    return "-s -w " + " ".join(f"-X {k}={v}" for k, v in x.items())


def _go_install(out: Path, name: str, target: str, env: dict[str, str], flags: str) -> None:
    """``go install target`` into a private GOBIN, then move the binary to ``out/name``."""
    henv = dict(env, GOBIN=str(out / f".{name}-gobin"))
    _run(["go", "install", "-v", "-trimpath", "-ldflags", flags, target], out.parent, henv,
         f"build {name}", quiet_lines=True)
    built = target.split("@")[0].rsplit("/", 1)[1]
    (out / f".{name}-gobin" / built).replace(out / name)
    shutil.rmtree(out / f".{name}-gobin", ignore_errors=True)


def build(version: str = K8S_VERSION, helm_version: str = HELM_VERSION,
          force: bool = False, names: tuple[str, ...] = ALL_BINARIES) -> Path:
    """Build whichever of ``names`` is missing into ``bin_dir(version)``; return that directory.

    Raises RuntimeError with the failing command and its output tail when a build fails.
    """
    out = bin_dir(version)
    todo = names if force else tuple(missing_binaries(version, names))
    if not todo:
        return out
    if shutil.which("go") is None:
        raise RuntimeError("the Go toolchain ('go') is required to build the local cluster")
    started = time.monotonic()
    _log(f"building {', '.join(todo)} into {out} (cold: 10-20 min on 2 cores)")
    out.mkdir(parents=True, exist_ok=True)
    work = out.parent / "src"
    env = _go_env(work)
    k8s_todo = [b for b in todo if b in K8S_COMMANDS]
    if k8s_todo:
        _prepare_module(work, env, version)
        ldflags = _k8s_ldflags(version)
        for name in k8s_todo:
            pkg = "./etcd" if name == "etcd" else f"k8s.io/kubernetes/cmd/{name}"
            tmp = out / f".{name}.partial"
            _run(["go", "build", "-v", "-trimpath", "-ldflags", ldflags, "-o", str(tmp), pkg],
                 work, env, f"build {name}", quiet_lines=True)
            tmp.replace(out / name)
    if "helm" in todo:
        minor = version.lstrip("v").split(".")[1]
        # The capabilities helm assumes without a cluster (template, lint) and the version
        # its deprecation lint checks against; both default to Kubernetes 1.20.
        flags = "-s -w " + " ".join(
            f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersion{part}={value}"
            for pkg in ("chartutil", "lint/rules")
            for part, value in (("Major", "1"), ("Minor", minor)))
        _go_install(out, "helm", f"helm.sh/helm/v3/cmd/helm@{helm_version}", env, flags)
    for name in (b for b in todo if b in GO_INSTALLS):
        _go_install(out, name, GO_INSTALLS[name], env, "-s -w")
    elapsed = time.monotonic() - started
    (out.parent / "build-time.txt").write_text(f"{elapsed:.0f} s for {', '.join(todo)}\n")
    _log(f"done in {elapsed:.0f} s")
    return out


def ensure_binaries(version: str = K8S_VERSION, names: tuple[str, ...] = ALL_BINARIES) -> Path:
    """Return the cache bin directory, building any of ``names`` on a miss (prints progress).
    Concurrent callers (two test sessions on a fresh machine) take turns on a lock file; the
    second finds the binaries built."""
    if not missing_binaries(version, names):
        return bin_dir(version)
    lock_path = bin_dir(version).parent / ".build.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"another process is building into {bin_dir(version)}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if missing_binaries(version, names):
            return build(version, names=names)
    return bin_dir(version)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument("--print-bin-dir", action="store_true", help="print the bin dir and exit")
    p.add_argument("--node", action="store_true",
                   help="also build the node: kubelet, kube-proxy, crictl, coredns")
    args = p.parse_args(argv)
    if args.print_bin_dir:
        print(bin_dir())
        return 0
    names = ALL_BINARIES + (NODE_BINARIES if args.node else ())
    d = build(force=args.force, names=names)
    for b in names:
        print(d / b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
