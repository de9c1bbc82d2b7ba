"""The CNCF distribution registry (built by scripts/servers-build.sh) as a test server: htpasswd
(basic) authentication for one user, filesystem storage in a directory of the test's, models
pushed as OCI artifacts one layer a file (titled by org.opencontainers.image.title, as `oras
push` makes them) through the distribution API; and a proxy of the test's that sends blobs slowly
(a download long enough to watch). Standard library only."""
import base64
import hashlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import threading
import time

USER, PASSWORD = "puller", "puller-pass"
# bcrypt of PASSWORD (the registry's htpasswd reads bcrypt only)
HTPASSWD = f"{USER}:$2b$05$wGRmpsxEXj5GYBecdG6Zwuim0tLqAr7Q6oDSj3KDH76xIohFSJMK.\n"
AUTH = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


def wait_port(host, port, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


def docker_config(registry, user=USER, password=PASSWORD):
    """A Docker config (an image pull Secret's .dockerconfigjson) for `registry` (host:port)."""
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    return json.dumps({"auths": {registry: {"auth": auth}}})


class RegistryServer:
    def __init__(self, servers_bin, workdir, host="127.0.0.1", port=0):
        self.host = host
        if port == 0:
            s = socket.socket()
            s.bind((host, 0))
            port = s.getsockname()[1]
            s.close()
        self.port = port
        self.address = f"{host}:{port}"
        self.storage = os.path.join(workdir, "registry")
        with open(os.path.join(workdir, "htpasswd"), "w") as f:
            f.write(HTPASSWD)
        config = os.path.join(workdir, "registry.yml")
        with open(config, "w") as f:
            f.write(f"""version: 0.1
log: {{level: error}}
storage: {{filesystem: {{rootdirectory: {self.storage}}}, delete: {{enabled: true}}}}
http: {{addr: "{self.address}"}}
auth: {{htpasswd: {{realm: shardserve-test, path: {workdir}/htpasswd}}}}
""")
        self.proc = subprocess.Popen([os.path.join(servers_bin, "registry"), "serve", config],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_port(host, port):
            raise RuntimeError(f"the registry did not listen on {self.address}")

    def call(self, method, path, body=None, headers=None, auth=AUTH):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request(method, path, body=body,
                     headers={**({"Authorization": auth} if auth else {}), **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()

    def push_blob(self, repo, data):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        status, headers, _ = self.call("POST", f"/v2/{repo}/blobs/uploads/")
        assert status == 202, status
        location = headers["Location"]
        location += ("&" if "?" in location else "?") + f"digest={digest}"
        location = location.split(self.address)[-1]
        status, _, body = self.call("PUT", location, data,
                                    {"Content-Type": "application/octet-stream"})
        assert status == 201, (status, body)
        return digest

    def push_model(self, repo, tag, model_dir, names):
        """An OCI artifact as `oras push` makes one: an empty config, a layer a file; its digest."""
        config = self.push_blob(repo, b"{}")
        layers = []
        for name in names:
            data = open(os.path.join(model_dir, name), "rb").read()
            layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar",
                           "digest": self.push_blob(repo, data), "size": len(data),
                           "annotations": {"org.opencontainers.image.title": name}})
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "artifactType": "application/vnd.shardserve.model.v1",
            "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": config,
                       "size": 2},
            "layers": layers}).encode()
        status, _, body = self.call("PUT", f"/v2/{repo}/manifests/{tag}", manifest,
                                    {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        assert status == 201, (status, body)
        return "sha256:" + hashlib.sha256(manifest).hexdigest()

    def blob_file(self, data):
        """Where the registry keeps the blob of `data` (to corrupt it in place)."""
        h = hashlib.sha256(data).hexdigest()
        return os.path.join(self.storage, "docker/registry/v2/blobs/sha256", h[:2], h, "data")

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


class SlowProxy:
    """The registry, its blobs sent `piece` bytes at a time `pause` seconds apart; the client's
    own Authorization passed on (so the registry's challenge reaches the client)."""

    def __init__(self, registry, host="127.0.0.1", piece=65536, pause=0.05):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, headers, body = registry.call(
                    "GET", self.path, auth=self.headers.get("Authorization"),
                    headers={k: v for k, v in self.headers.items()
                             if k.lower() in ("range", "accept")})
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(0, len(body), piece):
                    self.wfile.write(body[i:i + piece])
                    if "/blobs/" in self.path:
                        time.sleep(pause)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.port = self.httpd.server_address[1]
        self.address = f"{host}:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
