"""A test server of ours that answers the Hugging Face Hub's documented endpoints for one model
directory, as the Hub does: GET /api/models/ORG/NAME/revision/REV[?blobs=true] (the commit, and
each file with its size, git blob id and, for LFS files, SHA-256), and GET|HEAD
/ORG/NAME/resolve/REV/PATH with byte ranges, LFS files redirected to a second path as the Hub
redirects them to its CDN. A token, when set, is required on the Hub's paths (401 without it) and
not on the CDN's. `corrupt` names a file whose bytes are served with one byte flipped, `overlong`
one whose answers carry a megabyte more than asked. (olah, the
Hub mirror on PyPI, serves only what it fetched from an upstream Hub, which no test here reaches.)
Standard library only."""
import hashlib
import http.server
import json
import os
import threading
import urllib.parse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def git_blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    def __init__(self, model_dir, repo, token=None, host="127.0.0.1"):
        self.repo = repo
        self.token = token
        self.corrupt = None
        self.overlong = None
        self.files = {}
        for name in sorted(os.listdir(model_dir)):
            with open(os.path.join(model_dir, name), "rb") as f:
                self.files[name] = f.read()
        self.commit = hashlib.sha1(b"".join(
            n.encode() + hashlib.sha256(d).digest() for n, d in self.files.items())).hexdigest()
        self.requests = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, status, body=b"", headers=()):
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def authorized(self):
                return server.token is None or \
                    self.headers.get("Authorization") == f"Bearer {server.token}"

            def serve_bytes(self, name):
                data = server.files[name]
                if name == server.corrupt:
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0xFF
                    data = bytes(data)
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    first, _, last = rng[6:].partition("-")
                    first = int(first)
                    last = int(last) if last else len(data) - 1
                    if first >= len(data):
                        return self.answer(416)
                    extra = b"x" * (1 << 20) if name == server.overlong else b""
                    return self.answer(206, data[first:last + 1] + extra, [
                        ("Content-Range", f"bytes {first}-{last}/{len(data)}")])
                return self.answer(200, data)

            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                path = urllib.parse.unquote(url.path)
                server.requests.append(path)
                if path.startswith("/lfs-cdn/"):  # no token here, as on the Hub's CDN
                    for name, data in server.files.items():
                        if hashlib.sha256(data).hexdigest() == path[len("/lfs-cdn/"):]:
                            return self.serve_bytes(name)
                    return self.answer(404)
                api = f"/api/models/{server.repo}/revision/"
                resolve = f"/{server.repo}/resolve/"
                if not (path.startswith(api) or path.startswith(resolve)):
                    return self.answer(404, b'{"error": "Repository Not Found"}')
                if not self.authorized():
                    return self.answer(401, b'{"error": "Invalid credentials"}')
                if path.startswith(api):
                    rev = path[len(api):]
                    if rev not in ("main", server.commit):
                        return self.answer(404, b'{"error": "Revision Not Found"}')
                    siblings = []
                    for name, data in server.files.items():
                        e = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
                        if name.endswith(LFS_SUFFIXES):
                            e["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                        "size": len(data), "pointerSize": 134}
                        siblings.append(e)
                    body = json.dumps({"id": server.repo, "modelId": server.repo,
                                       "sha": server.commit, "siblings": siblings}).encode()
                    return self.answer(200, body, [("Content-Type", "application/json")])
                rev, _, name = path[len(resolve):].partition("/")
                if rev not in ("main", server.commit) or name not in server.files:
                    return self.answer(404, b'{"error": "Entry not found"}')
                if name.endswith(LFS_SUFFIXES):
                    sha = hashlib.sha256(server.files[name]).hexdigest()
                    return self.answer(302, b"", [("Location", f"/lfs-cdn/{sha}"),
                                                  ("X-Repo-Commit", server.commit)])
                return self.serve_bytes(name)

            do_HEAD = do_GET

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
