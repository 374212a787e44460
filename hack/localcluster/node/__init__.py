"""The real node: containerd, runc, CNI, kubelet, kube-proxy, CoreDNS (see real_node.py)."""
