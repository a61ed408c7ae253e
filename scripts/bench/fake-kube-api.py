#!/usr/bin/env python3
"""A minimal local Kubernetes API for benchmarks: serves PODS pods of node
NODE on /api/v1/pods (a LIST, then a WATCH that sends one bookmark and stays
open until the server-side timeout), plain HTTP on 127.0.0.1:PORT.

    scripts/bench/fake-kube-api.py PORT NODE PODS

Prints "ready <port>" once it listens. Loopback only; it stops when killed.
The pods look like what the API server sends (labels, owner references,
managed fields, a container status with a containerd id), so the client's
decoding does real work. Used by scripts/bench/kube-rss.
"""
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


def pod_uid(i):
    h = f"{i:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def container_id(i):
    return f"{i:064x}"


def pod(i, node):
    name = f"trainer-{i}"
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": f"team-{i % 10}",
            "uid": pod_uid(i),
            "resourceVersion": str(100 + i),
            "creationTimestamp": "2025-06-01T09:59:58Z",
            "labels": {"app.kubernetes.io/name": name, "team": f"team-{i % 10}"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                 "uid": pod_uid(100000 + i), "controller": True}],
            "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
                               "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}],
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "trainer", "image": "nvcr.io/nvidia/pytorch:24.01-py3",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "restartPolicy": "Never",
            "schedulerName": "default-scheduler",
        },
        "status": {
            "phase": "Running",
            "hostIP": "10.0.0.5",
            "podIP": f"10.244.{i // 250}.{i % 250}",
            "qosClass": "Burstable",
            "containerStatuses": [{
                "name": "trainer",
                "image": "nvcr.io/nvidia/pytorch:24.01-py3",
                "imageID": "nvcr.io/nvidia/pytorch@sha256:4f2e",
                "containerID": f"containerd://{container_id(i)}",
                "ready": True, "restartCount": 0, "started": True,
                "state": {"running": {"startedAt": "2025-06-01T10:00:00Z"}},
            }],
        },
    }


def main():
    port, node, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    items = [pod(i, node) for i in range(count)]
    rv = str(100 + count)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            url = urlparse(self.path)
            q = parse_qs(url.query)
            if url.path != "/api/v1/pods":
                self.send_error(404)
                return
            if q.get("watch", [""])[0] in ("1", "true"):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                line = json.dumps({"type": "BOOKMARK", "object": {
                    "kind": "Pod", "apiVersion": "v1",
                    "metadata": {"resourceVersion": rv}}}) + "\n"
                data = line.encode()
                try:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    timeout = int(q.get("timeoutSeconds", ["290"])[0])
                    time.sleep(min(timeout, 600))
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return
            body = json.dumps({"kind": "PodList", "apiVersion": "v1",
                               "metadata": {"resourceVersion": rv}, "items": items}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"ready {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
