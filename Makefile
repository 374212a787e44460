# Shardline: the two commands of the README are `make demo` and `make test`.
PYTHON ?= python3
PIP_FLAGS ?= --disable-pip-version-check

.PHONY: install test test-node test-chaos demo test-fast test-quick gpu-check images node-deps

install:
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[dev]'

## The whole suite: unit, runtime, serving, operator, chart, cluster and e2e tiers (not the
## real-node tier: it builds both images, see test-node).
test: install
	$(PYTHON) -m pytest tests -m "not node and not chaos"

## The rollout fault suite (issue 23) in the local cluster: out of `make test` while its
## fixture's wait for a loading leader times out in some runs (cause not yet found).
test-chaos: install
	$(PYTHON) -m pytest tests -m chaos

## The real-node tier: both images, a kubelet + containerd + runc node per cluster (root).
test-node: install images
	$(PYTHON) -m pytest tests -m node

## Everything but the local-cluster tiers (no Go build needed).
test-fast: install
	$(PYTHON) -m pytest tests -m "not cluster and not e2e and not node"

## Unit and single-process tests only (no slow, cluster or e2e tier).
test-quick: install
	$(PYTHON) -m pytest tests -m "not slow and not cluster and not e2e and not node"

## The main job: local Kubernetes (a real kubelet running containers where root; hack/demo.py --node),
## kubectl apply, serve, roll weights, tear down.
demo: install
	$(PYTHON) hack/demo.py

gpu-check:
	bash bench/gpu_check.sh

## Debian packages for the images and the real node (buildah, mmdebstrap, containerd, runc, CNI).
node-deps:
	bash hack/install_node_deps.sh

## Both container images, built with buildah on an mmdebstrap base, cached by input hash,
## and imported into containerd when one runs (python3 -m hack.images --help).
images: node-deps
	$(PYTHON) -m hack.images
